"""Every divisibility rule a layout must follow before anything is emitted (dtlib.analytic.layout.RULES):
one line naming the field, its value and the valid values, through the API (ValueError) and the
CLI (exit 2, one line on stderr)."""
import pytest

from dtlib.analytic.layout import Parallelism, check_layout
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.presets import get_preset
from dtlib.cli import main
from dtlib.models import TransformerConfig

DSV3 = get_preset("deepseek-v3")
LLAMA = get_preset("llama3-8b")

# (model, layout, CLI flags of both, the message): heads / kv_heads / FFN by tp, the expert width
# by etp, the shared-expert width by tp (Megatron-Core's SharedExpertMLP splits moe_ffn x
# shared_experts over tp: before, only building the layer failed), experts by ep, layers by pp x v
CASES = {
    "heads": (LLAMA, dict(tp=3), ["--model", "llama3-8b", "--tp", "3", "--dp", "1"],
              "tensor parallel size tp=3 must divide the 32 attention heads; valid tp: 1, 2, 4, 8, 16, 32"),
    "kv_heads": (LLAMA, dict(tp=16), ["--model", "llama3-8b", "--tp", "16", "--dp", "1"],
                 "tp=16 must divide the 8 KV heads (kv_heads, Megatron's query groups); valid tp: 1, 2, 4, 8"),
    "ffn": (TransformerConfig(name="custom", layers=4, hidden=512, heads=8, ffn=2052, vocab=1000, seq=128), dict(tp=8),
            ["--layers", "4", "--hidden", "512", "--heads", "8", "--ffn", "2052", "--vocab", "1000", "--seq", "128",
             "--tp", "8", "--dp", "1"],
            "tp=8 must divide the FFN width 2052 (ffn); valid tp: 1, 2, 3, 4, 6, 9"),
    "moe_ffn": (DSV3.with_(moe_ffn=2052), dict(dp=64, ep=8, etp=8),
                ["--model", "deepseek-v3", "--expert-ffn", "2052", "--dp", "64", "--ep", "8", "--etp", "8"],
                "expert tensor parallel size etp=8 must divide moe_ffn=2052 (the expert FFN width); valid etp: 1, 2, 3, 4"),
    "shared experts": (DSV3.with_(moe_ffn=2052), dict(tp=8, ep=8, sequence_parallel=True),
                       ["--model", "deepseek-v3", "--expert-ffn", "2052", "--tp", "8", "--ep", "8", "--dp", "1",
                        "--sequence-parallel"],
                       "tp=8 must divide the shared-expert width moe_ffn x shared_experts = 2052"),
    "experts": (DSV3, dict(dp=6, ep=6), ["--model", "deepseek-v3", "--dp", "6", "--ep", "6"],
                "expert parallel size ep=6 must divide experts=256; valid ep: 1, 2, 4, 8, 16, 32, 64, 128, 256"),
    "layers": (DSV3, dict(pp=16), ["--model", "deepseek-v3", "--pp", "16", "--dp", "1"],
               "61 layers over pp=16 x virtual_stages=1 is not a split Megatron-LM accepts"),
}


@pytest.mark.parametrize("name", CASES)
def test_each_rule_says_the_field_its_value_and_the_valid_values(name, capsys):
    model, layout, flags, message = CASES[name]
    with pytest.raises(ValueError) as api:
        memory_per_gpu(model, Parallelism(**layout))
    assert message in str(api.value) and "\n" not in str(api.value)
    assert main(["memory", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_widths_and_the_split_pass_when_they_divide():
    ok = Parallelism(tp=4, ep=8, dp=2, sequence_parallel=True)  # 2052 = 4 x 513
    check_layout(ok.numbers(**DSV3.with_(moe_ffn=2052).numbers()))
    with pytest.raises(ValueError, match="valid: first_stage_layers=3, last_stage_layers=2"):
        check_layout(Parallelism(pp=16).numbers(**DSV3.numbers()))
    check_layout(Parallelism(pp=16, first_stage_layers=3, last_stage_layers=2).numbers(**DSV3.numbers()))
