"""Published training runs: the data the planner is validated on (no logic; :mod:`dtlib.plan.validation`
predicts, fits and cross-validates).

Each :class:`PublishedRun` is one row of one published table: the model, the cluster, the layout
as published, the software stack, the precision and the published number, with its source (the
short name leave-one-source-out holds out) and the reference (citation, link, table and row).
Knobs a source does not state are left out of ``layout``: the planner picks the fastest setting
that fits, as ``dtlib plan`` does with the published flags; each row's ``note`` says what was not
stated and what was assumed. Every number was read from the linked text (``docs/validation.md``
lists the sources and what each gave).

Rows the current planner cannot express (MoE presets, GB200/GB300 racks: the names of issue 26's
contract, built by other branches) are built by :func:`pending_runs`, which raises if a name is
missing; :data:`INCLUDE_PENDING` is the one switch that adds them to :data:`PUBLISHED`. The
DeepSeek-V3 report's row (:func:`deepseek_v3_runs`) waits likewise behind :data:`INCLUDE_DEEPSEEK_V3`
for ``PublishedRun.ep_overlap`` (DualPipe).

About 1,200 lines because it is seventeen sources' tables transcribed row by row (and the AMD
comparison); splitting it by source would scatter the shared conventions (units, stack knobs) that
the rows must agree on.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.finetune import FineTuning
from dtlib.analytic.flops import check_packed
from dtlib.analytic.hardware import Cluster, Link, cluster, get_gpu
from dtlib.analytic.presets import get_preset
from dtlib.analytic.units import GiB

__all__ = ["PublishedRun", "PUBLISHED", "SOURCES", "METRIC_UNITS", "STACKS", "LAYOUT_KEYS", "INCLUDE_PENDING",
           "INCLUDE_DEEPSEEK_V3", "published", "pending_runs", "deepseek_v3_runs", "NEMO_FINETUNING",
           "BRIDGE_FINETUNING", "amd_comparison_runs"]

# the one switch: True once the contract's names exist on main (MoE presets, gb200/gb300)
INCLUDE_PENDING = True
# DeepSeek-V3's report row needs PublishedRun.ep_overlap (DualPipe; physics branch): True once it is on main
INCLUDE_DEEPSEEK_V3 = True

# the unit each published metric is quoted in (every row of the table carries its own)
METRIC_UNITS = {"hardware_tflops_per_gpu": "TFLOP/s/GPU", "model_tflops_per_gpu": "model TFLOP/s/GPU",
                "step_time_s": "s/step", "tokens_per_gpu_s": "tokens/s/GPU"}
# the software stacks of issue 26 (dtlib.analytic.stacks)
STACKS = ("megatron", "torchtitan", "deepspeed", "fsdp")
# layout keys a row may publish (Megatron's names; etp and recompute_layers: issue 26's contract)
LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "etp", "zero", "sequence_parallel", "recompute", "recompute_layers",
               "virtual_stages", "micro_batch_size", "account_for_embedding_and_loss", "activation_offload_layers",
               "offload", "recompute_modules", "first_stage_layers", "last_stage_layers", "pipeline_layout", "schedule")

_NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters "
              "Using Megatron-LM', Table 1 (A100 80GB, seq 2048, V 51200, full recomputation; "
              "TFLOP/s per GPU counted with eq. 3, i.e. hardware FLOPs) https://arxiv.org/abs/2104.04473")
_KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer "
                "Models', Table 3 (configurations: seq 2048, V 51200, tp 8, dp 1) and Table 5 (iteration "
                "time, sequence parallelism + selective recompute) https://arxiv.org/abs/2205.05198")
_BLOOM = ("BigScience 2022, 'BLOOM', engineering section (384 A100 80GB, 48 nodes, 4 x 100 Gb/s Omni-Path "
          "per node, tp 4 x pp 12 x dp 8, bf16, ZeRO-1 equivalent BF16Optimizer; 156 TFLOP/s per GPU in the "
          "fastest configuration) https://arxiv.org/abs/2211.05100, the same 156 TFLOP/s sustained per GENCI "
          "https://www.genci.fr/en/news/bloom-one-largest-open-multilingual-nlp-models-awarded-best-hpc-"
          "collaboration-hpc-wire-readers, and train/tr11-176B-ml/tr11-176B-ml.slurm (MBS 2, GBS 2048, "
          "activation checkpointing) https://github.com/bigscience-workshop/bigscience")
_TITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e at 500 W, 400 Gb/s "
          "per GPU, bf16, eager) https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
          "llama3_h100_202412_torchtitan.md")
_ASYNC_TP = ("torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (same Grand Teton hosts: H100 "
             "96GB HBM2e, 500 W, 400 Gb/s per GPU; torch.compile) https://github.com/pytorch/torchtitan/blob/"
             "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md")
_BRIDGE = ("NVIDIA Megatron-Bridge performance summary, 25.11 NeMo container, seq 8192 (Llama) / 4096 (MoE), "
           "docs/performance-summary-archive.md '25.11 NeMo Container' "
           "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/067f987df03b8355b03192d88d70f1709fedf51a/"
           "docs/performance-summary-archive.md; recipes scripts/performance/configs/*/workload_base_configs.py "
           "at 166d498a51d6d84ea93e98875b0ed4f7bd096a7e (the 25.11 summary commit)")
_BRIDGE_FP4 = ("NVIDIA Megatron-Bridge performance summary, 26.04.01 NeMo container, seq 8192, "
               "docs/performance-summary-archive.md '26.04.01 NeMo Container', Pre-Training Performance, tables "
               "'Model: LLAMA3_70B' and 'Model: LLAMA3.1_405B', NVFP4 rows https://github.com/NVIDIA-NeMo/"
               "Megatron-Bridge/blob/067f987df03b8355b03192d88d70f1709fedf51a/docs/performance-summary-archive.md; "
               "recipes src/megatron/bridge/perf_recipes/llama/{gb300,gb200}/{llama3,llama31}.py "
               "(*_nvfp4_config: layout, tp_comm_overlap False) and scripts/performance/utils/precision.py "
               "(bf16_with_nvfp4_mixed: fp4 e2m1, fp4_recipe nvfp4, first_last_layers_bf16 left False) at that commit")
_NEMO = ("NVIDIA NeMo performance summary, NeMo 24.07 container, DGX-H100, FP8, "
         "docs/source/performance/performance_summary.md 'Pretraining' table "
         "https://github.com/NVIDIA/NeMo/blob/8e3d65dcfe3504689bfc5b6e67d502780aacad41/docs/source/performance/"
         "performance_summary.md; model shapes nemo/collections/llm/gpt/model/{base,llama}.py at that commit")
_NEMO_LONG = ("NVIDIA NeMo long-sequence performance, NeMo 24.03.01 container, DGX-H100, LLAMA2-7B FP8, "
              "docs/source/performance/performance_long_sequence.md, table 'LLAMA2-7B (FP8) - H100', 'With CP' "
              "columns (TP, PP, DP, CP, TFLOPS/GPU) https://github.com/NVIDIA/NeMo/blob/"
              "a2c4cc8ee64eb98d83684fc616dd0225c25bdfa1/docs/source/performance/performance_long_sequence.md")
_NEMO_FT = ("NVIDIA NeMo performance summary, NeMo 24.07 container, DGX-H100, FP8, docs/source/performance/"
            "performance_summary.md 'Finetuning' table (SQuAD v1.1 packed to 4096 tokens; SFT and LoRA) "
            "https://github.com/NVIDIA/NeMo/blob/8e3d65dcfe3504689bfc5b6e67d502780aacad41/docs/source/performance/"
            "performance_summary.md; what the table leaves out from NeMo-Framework-Launcher 24.07 "
            "launcher_scripts/conf/peft/llama/sft.yaml (peft_scheme null = SFT or lora; lora_tuning adapter_dim "
            "32 without target_modules; recompute, SP, VP, ub_tp_comm_overlap, distributed_fused_adam) "
            "https://github.com/NVIDIA/NeMo-Framework-Launcher/blob/8325688d8345a5513660f0f8390f0482a721c009/"
            "launcher_scripts/conf/peft/llama/sft.yaml and NeMo's default LoRA target (get_target_modules, "
            "default ('attention_qkv',)) nemo/collections/nlp/parts/peft_config.py at the table's commit")
_BRIDGE_FT = ("NVIDIA Megatron-Bridge performance summary, 26.06 NeMo container, Llama 3 70B, seq 4096, GBS 32, MBS 1, "
              "docs/performance-summary-archive.md '26.06 NeMo Container', tables 'SFT Performance' and 'LoRA "
              "Performance' (Model: LLAMA3_70B) https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/"
              "067f987df03b8355b03192d88d70f1709fedf51a/docs/performance-summary-archive.md; recipes "
              "src/megatron/bridge/perf_recipes/llama/{gb300,gb200,h100}/llama3.py and perf_recipes/_common.py "
              "(_perf_precision: FP8 = fp8_cs, current scaling, first_last_layers_bf16 False; _benchmark_common), "
              "base configs src/megatron/bridge/recipes/llama/h100/llama3.py (llama3_70b_sft_config, line 1762; "
              "llama3_70b_peft_config, line 2576: LoRA dim 16, alpha 32) and recipes/common.py (_sft_common, "
              "_peft_common: SQuAD, offline packing) at that commit; the same layouts in the 26.06 release's "
              "scripts/performance/configs/llama/llama3_workload_base_configs.py at v0.5.0 "
              "fcbb6031103d0ca845c1a54d4fee55ecfcca17b6")
_NEMO_2025 = ("NVIDIA NeMo Framework performance summary of 2025 (NeMo 2.x on Megatron-Core, FP8), 'Pre-training' "
              "tables: NeMo 25.02, System DGX-B200, as stored at https://docs.nvidia.com/nemo-framework/user-guide/"
              "latest/performance/performance_summary.html while it showed 25.02; NeMo 25.04, System DGX-GB200, "
              "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/archive/25.04-performance-"
              "summary.html; recipes scripts/performance/recommended_model_configs/model_configs_{b200,gb200}.csv "
              "https://github.com/NVIDIA/NeMo/blob/3310699cbc5d2cfef35871107e36c0d53892c194/scripts/performance/"
              "recommended_model_configs/ (25.04-alpha.rc1, 2025-03-17: the B200 rows' layouts) and at r2.3.0 "
              "ca0af5eaa63dd4acf5f66e9a6e98d980e956efe9 (the GB200 rows')")
_DEEPSEEK_V3 = ("DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', Sec. 1 (180K H800 GPU hours per trillion "
                "tokens; 2.664M GPU hours for the 14.8T pre-training tokens), Sec. 3.1-3.2 (2,048 H800, 8 per node, "
                "NVLink within and InfiniBand across nodes; 16-way PP, 64-way EP over 8 nodes, ZeRO-1 DP, no TP; "
                "DualPipe), Sec. 3.3 (FP8 with fine-grained tile/block scaling), Sec. 4.2 (seq 4K; batch ramped "
                "from 3,072 to 15,360 sequences over the first 469B tokens) https://arxiv.org/abs/2412.19437")
_MPT = ("MosaicML llm-foundry, 'MPT Training Benchmarks', scripts/train/benchmarking/README.md "
        "https://github.com/mosaicml/llm-foundry/blob/8c8dd48f72168c5d51e2f7b151595892a8fba43d/scripts/train/"
        "benchmarking/README.md; shapes scripts/train/yamls/pretrain/mpt-*.yaml (vocab 50368, expansion 4, "
        "attn_impl flash), MPTConfig defaults (no dropout, learned positions)")
_TRAINY = ("Trainy on WhiteFiber, torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (8 H200 per "
           "host, 400 Gb/s CX-7 per GPU; llama3_8b.toml, local batch 2, torch.compile, Float8 with FSDP float8 "
           "all-gather) https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
           "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md")
_DEEPSPEED = ("DeepSpeed team 2022, 'Azure empowers easy-to-use, high-performance, and hyperscale model training "
              "using DeepSpeed', docs/_posts/2022-07-26-deepspeed-azure.md (NDm A100 v4: 8 A100 80GB, one 200 "
              "Gb/s HDR InfiniBand per GPU; Table 2 shapes; TFLOP/s by the Megatron formula 96 B s l h^2 "
              "(1 + s/6h + V/16lh), i.e. hardware FLOPs with recomputation) https://github.com/microsoft/"
              "DeepSpeed/blob/38327e07f6cd39b63418f60cedd1651b0be3e7c3/docs/_posts/2022-07-26-deepspeed-azure.md")
_LLAMA3 = ("Llama Team 2024, 'The Llama 3 Herd of Models', Sec. 3.3 and Table 4 (405B on 8K/16K H100 80GB at 700 W, "
           "400 Gb/s RoCE) https://arxiv.org/abs/2407.21783; the numbers as read from the table reproduced at "
           "https://glennklockwood.com/garden/llama-3.1 (GPUs, TP, CP, PP, tokens per batch, TFLOP/s per GPU; "
           "Balaji, SC'24) and the 8K-then-128K stages at https://ai-papers.xuzou.cn/papers/llama3_2024")

_DGXC = ("NVIDIA DGX Cloud Benchmarking, release 25.07 (gsw 25.05.04; NeMo 2.x containers 25.04.00/25.04.01), "
         "'Expected Performance' tables and layout tables of llama3.1/, nemotron/, deepseek_v3/pretraining/, "
         "grok1/ and llama4/README.md, their launch.sh (layouts, recompute modules, CUDA graphs), setup.sh (the "
         "NeMo commit each runs) and Notes (model shapes) "
         "https://github.com/NVIDIA/dgxc-benchmarking/tree/6be5ea0e19c583ee4d445a1cd65a3ff2fcb4e58b; "
         "the scripts they run: NeMo scripts/performance/llm/pretrain_*.py, utils.py and the recipes "
         "nemo/collections/llm/recipes/*.py at each setup.sh's NEMO_COMMIT (FP8: bf16_with_fp8_mixed, delayed "
         "scaling; grad_reduce_in_fp32 False in every recipe's performance mode but DeepSeek-V3's)")

# torchtitan's hosts: H100 with 96 GB HBM2e and 2.4 TB/s, SXM tensor cores and SMs, run at 500 W
TITAN_H100 = replace(get_gpu("h100-sxm"), name="h100-96gb", memory_bytes=96 * GiB,
                     memory_bandwidth=2.4e12, source=_TITAN + ": hardware section")
# Jean Zay's A100 nodes: 4 Omni-Path 100 Gb/s links per node of 8 GPUs (BLOOM Sec. 3.4)
OMNI_PATH = Link("omni-path-100", 12.5e9, 14e-6, "Intel Omni-Path 100 Gb/s per link; NCCL Net latency")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: ``metric`` is a key of :data:`METRIC_UNITS`; ``layout`` the published
    knobs (keys of :data:`LAYOUT_KEYS`, as published; unstated ones absent); ``stack`` the
    software (:data:`STACKS`); ``source`` the short name cross-validation leaves out;
    ``reference`` the citation, link, table and row; ``dtype`` the matmul precision and
    ``fp8_recipe`` its scaling (``""`` when bf16 or unstated); ``power_limit_w`` the GPUs' power
    cap (None: TDP). The software's knobs come from ``stack`` (:data:`dtlib.analytic.stacks.STACKS`);
    a row sets one only where that run differs from its stack's defaults, with the reason in its
    builder: ``convention`` (activation counting, e.g. ``korthikanti-2022`` for 2021-22
    Megatron-LM's stored scores and dropout), ``flash_attention``, ``dropout``,
    ``fused_elementwise`` (eager vs torch.compile runs), ``tp_overlap`` (async TP on or off),
    ``ep_overlap`` (1: the run overlapped its EP all-to-alls, Megatron's ``moe_a2a_overlap``),
    ``moe_dispatcher`` (``flex``: a megatron run with the flex dispatcher, DeepEP / HybridEP),
    ``precision`` (bytes per parameter, :data:`dtlib.analytic.precision.CONVENTIONS` or a dtype name:
    e.g. ``bf16-mixed`` for Megatron runs with ``grad_reduce_in_fp32=False``, BF16 gradients).
    ``finetune`` what the run trained (:data:`dtlib.analytic.finetune.FINETUNE`: ``full``, every weight,
    as pre-training; ``lora``: adapters of ``lora_rank`` on ``lora_targets``, HF PEFT's names, the rest
    frozen), :attr:`fine_tuning` as the planner takes it; ``packed_doc_length`` the tokens per document
    of a run whose sequences are packed from documents attended to one by one (None: not packed, or no
    citable mean length: :func:`_nemo_finetuning`)."""
    name: str
    model: TransformerConfig
    cluster: Cluster
    global_batch: int
    layout: dict[str, Any]
    metric: str
    published: float
    family: str
    source: str
    reference: str
    stack: str
    dropout: bool | None = None
    flash_attention: bool | None = None
    convention: str | None = None
    dtype: str = "bf16"
    fp8_recipe: str = ""
    power_limit_w: float | None = None
    fused_elementwise: bool | None = None
    tp_overlap: float | None = None
    ep_overlap: float = 0.0
    moe_dispatcher: str | None = None
    note: str = field(default="")
    precision: str | None = None
    finetune: str = "full"
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | None = None
    packed_doc_length: int | None = None

    def __post_init__(self) -> None:
        try:
            self.fine_tuning
            if self.packed_doc_length is not None:
                check_packed(self.packed_doc_length, self.model.seq)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        if self.metric not in METRIC_UNITS:
            raise ValueError(f"{self.name}: metric must be one of {sorted(METRIC_UNITS)}, got {self.metric!r}")
        if self.stack not in STACKS:
            raise ValueError(f"{self.name}: stack must be one of {STACKS}, got {self.stack!r}")
        unknown = set(self.layout) - set(LAYOUT_KEYS)
        if unknown:
            raise ValueError(f"{self.name}: unknown layout keys {sorted(unknown)}; valid: {', '.join(LAYOUT_KEYS)}")

    @property
    def fine_tuning(self) -> FineTuning:
        """What the run trained, as :func:`dtlib.plan.search.search` takes it."""
        return FineTuning(self.finetune, self.lora_rank, self.lora_targets)

    @property
    def unit(self) -> str:
        """The published metric's unit."""
        return METRIC_UNITS[self.metric]


def _gpt(name: str, layers: int, hidden: int, heads: int, source: str, vocab: int = 51200,
         seq: int = 2048) -> TransformerConfig:
    return TransformerConfig(name=name, layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                             seq=seq, tied_embeddings=True, source=source)


def _dgx(gpu: str, gpus: int, inter: str = "ib-ndr") -> Cluster:
    """A DGX/HGX cluster of ``gpus`` GPUs, 8 per node (fewer: one partial node)."""
    return cluster(gpu, max(gpus // 8, 1), min(gpus, 8), None, inter)


def _system_cluster(gpu: str, gpus: int) -> Cluster:
    """A DGX system's ``gpus`` GPUs: GB200/GB300 NVL72 racks as NVLink domains of the job's GPUs up to 64
    (the tables do not say how 256 GPUs sit in 72-GPU racks: 4 x 64 assumed), inter-rack NIC 800 Gb/s
    (GB300) or 400 Gb/s (GB200), neither stated in the tables; other GPUs as :func:`_dgx`."""
    if not gpu.startswith("gb"):
        return _dgx(gpu, gpus)
    domain = min(gpus, 64)
    return cluster(gpu, gpus // domain, domain, "nvlink5", "ib-xdr" if gpu == "gb300" else "ib-ndr")


# (billions, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU) -- Table 1, in order
_TABLE1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]

# (name, heads, hidden, layers, pp, gpus, global batch, seconds per iteration) -- Tables 3 and 5
_TABLE5 = [("22B", 64, 6144, 48, 1, 8, 4, 1.10), ("175B", 96, 12288, 96, 8, 64, 64, 13.75),
           ("530B", 128, 20480, 105, 35, 280, 280, 37.83), ("1T", 160, 25600, 128, 64, 512, 512, 71.49)]


# fp32 main gradients, reduced in fp32, where the run's software did so (the megatron stack's default is
# Megatron-Core's bf16): Megatron-LM's own script (arguments.py with --bf16:
# accumulate_allreduce_grads_in_fp32 = True), NeMo (MegatronMixedPrecision / DtypeConfig
# grad_reduce_in_fp32 = True by default, overriding Megatron-Core's DistributedDataParallelConfig)
_FP32_GRADS = "megatron-bf16"
# Megatron-LM of 2021-22: fused softmax storing the scores, dropout 0.1, no TP communication overlap
_MEGATRON_2021 = dict(convention="korthikanti-2022", tp_overlap=0.0, precision=_FP32_GRADS)


def _papers_2021_2022() -> list[PublishedRun]:
    """Narayanan 2021 Table 1, Korthikanti 2022 Table 5 and BLOOM: Megatron-LM of 2021-22 (fused
    softmax, scores stored: ``flash_attention`` False)."""
    rows = []
    megatron = dict(zero=0, sequence_parallel=0, recompute="full")  # Megatron-LM of 2021
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in _TABLE1:
        rows.append(PublishedRun(
            name=f"GPT {billions:g}B (Narayanan T1)",
            model=_gpt(f"gpt-{billions:g}b", layers, hidden, heads, _NARAYANAN),
            cluster=cluster("a100-80gb", gpus // 8, 8, "nvlink3", "ib-hdr"), global_batch=batch,
            layout=dict(megatron, tp=tp, pp=pp, dp=gpus // (tp * pp), cp=1), metric="hardware_tflops_per_gpu",
            published=tflops, family="a100", source="Narayanan 2021", reference=_NARAYANAN, stack="megatron",
            **_MEGATRON_2021))
    for size, heads, hidden, layers, pp, gpus, batch, seconds in _TABLE5:
        rows.append(PublishedRun(
            name=f"GPT {size}, SP + selective (Korthikanti T5)",
            model=_gpt(f"gpt-{size.lower()}", layers, hidden, heads, _KORTHIKANTI),
            cluster=cluster("a100-80gb", max(gpus // 8, 1), 8, "nvlink3", "ib-hdr"), global_batch=batch,
            layout=dict(tp=8, pp=pp, dp=1, cp=1, zero=0, sequence_parallel=1, recompute="selective"),
            metric="step_time_s", published=seconds, family="a100", source="Korthikanti 2022",
            reference=_KORTHIKANTI, stack="megatron", **_MEGATRON_2021))
    rows.append(PublishedRun(
        name="BLOOM 176B (BigScience)", model=get_preset("bloom-176b"),
        cluster=Cluster(get_gpu("a100-80gb"), 48, 8, cluster(intra="nvlink3").intra, OMNI_PATH, nics_per_node=4),
        global_batch=2048, layout=dict(tp=4, pp=12, dp=8, cp=1, zero=1, sequence_parallel=0, recompute="full",
                                       micro_batch_size=2),
        metric="hardware_tflops_per_gpu", published=156, family="a100", source="BLOOM 2022", reference=_BLOOM,
        stack="deepspeed", dropout=False, flash_attention=False, fused_elementwise=True,
        note="Megatron-DeepSpeed's fused softmax (scores stored) and fused kernels; vocabulary padded to 250,880 as Megatron-DeepSpeed does; dropout 0"))
    return rows


def _torchtitan() -> list[PublishedRun]:
    """torchtitan's own benchmark files (PyTorch team, Grand Teton H100 96GB at 500 W)."""
    rows = []
    inter = cluster(inter="roce-400g").inter
    # "selective AC" in torchtitan is per-op unless the file says layer-wise: job_config's
    # activation_checkpoint.selective_ac_option defaults to "op" (dtlib.analytic.activations.op_selective_bytes)
    titan = dict(zero=3, sequence_parallel=0, recompute="op", tp=1, pp=1, cp=1, micro_batch_size=2)
    hopper = dict(power_limit_w=500,
                  source="torchtitan", stack="torchtitan", metric="tokens_per_gpu_s", family="h100")
    for gpus, table, eager, compiled, float8 in ((8, 1, 5762, 6667, 8532), (128, 3, 5605, 6514, 8380)):
        for label, tps, fused, dtype in (("eager", eager, False, "bf16"), ("compile", compiled, True, "bf16"),
                                         ("compile + Float8", float8, True, "fp8")):
            rows.append(PublishedRun(
                name=f"Llama 3.1 8B, FSDP {gpus}, {label} (torchtitan T{table})", model=get_preset("llama3-8b"),
                cluster=Cluster(TITAN_H100, gpus // 8, 8, cluster().intra, inter),
                global_batch=2 * gpus, layout=dict(titan, dp=gpus), published=tps,
                reference=_TITAN + f", Table {table}: local batch 2, selective AC, FSDP, {label}",
                fused_elementwise=fused, dtype=dtype, fp8_recipe="tensorwise" if dtype == "fp8" else "", **hopper))
    rows.append(PublishedRun(
        name="Llama 3.1 70B, FSDP 32 x TP 8, compile + Float8 (torchtitan T4)", model=get_preset("llama3-70b"),
        cluster=Cluster(TITAN_H100, 32, 8, cluster().intra, inter),
        global_batch=512, layout=dict(dp=32, tp=8, pp=1, cp=1, zero=3, sequence_parallel=1, recompute="full",
                                      micro_batch_size=16),
        published=829, dtype="fp8", fp8_recipe="tensorwise", fused_elementwise=True,  # torch.compile
        reference=_TITAN + ", Table 4: 2D (FSDP 32, TP 8), local batch 16, full AC, torch.compile + Float8",
        **hopper))
    # asyncTP file: (model, GPUs, dp, local batch, recompute, [(quantization, vanilla, async)])
    for preset, gpus, dp, local, recompute, label, results in (
            ("llama3-70b", 256, 32, 16, "full", "full AC", (("bf16", 597.3, 652.4), ("fp8", 809.8, 942.4))),
            ("llama3-8b", 64, 8, 12, "op", "per-op SAC", (("bf16", 4378, 4809.4), ("fp8", 5078.1, 5570.1)))):
        for dtype, vanilla, async_tp in results:
            for kind, tps, overlap in (("vanilla TP", vanilla, 0.0), ("async TP", async_tp, 1.0)):
                quant = "float8 tensorwise" if dtype == "fp8" else "bfloat16"
                rows.append(PublishedRun(
                    name=f"Llama 3.1 {preset[7:].upper()}, FSDP {dp} x TP 8, {quant}, {kind} (torchtitan asyncTP)",
                    model=get_preset(preset), cluster=Cluster(TITAN_H100, gpus // 8, 8, cluster().intra, inter),
                    global_batch=local * dp, layout=dict(dp=dp, tp=8, pp=1, cp=1, zero=3, sequence_parallel=1,
                                                         recompute=recompute, micro_batch_size=local),
                    published=tps, dtype=dtype, fp8_recipe="tensorwise" if dtype == "fp8" else "",
                    tp_overlap=overlap, fused_elementwise=True,  # every row of the file uses torch.compile
                    reference=_ASYNC_TP + f", table '{preset[7:]} on {gpus} H100s with FSDP={dp}, TP=8, "
                                          f"torch.compile, {label}, local batch size {local}', row {quant}, {kind}",
                    note="tokens/s per GPU (torchtitan's logged tps is per device); TP with sequence parallelism "
                         "(torchtitan's TP shards norms along the sequence); async TP timed as fully overlapped",
                    **hopper))
    return rows


def _trainy() -> list[PublishedRun]:
    """Trainy's H200 runs of torchtitan (a separate operator and cluster from the PyTorch team)."""
    return [PublishedRun(
        name=f"Llama 3.1 8B, FSDP {8 * nodes}, compile + Float8, H200 (Trainy)", model=get_preset("llama3-8b"),
        cluster=_dgx("h200", 8 * nodes, "roce-400g"), global_batch=2 * 8 * nodes,
        layout=dict(dp=8 * nodes, tp=1, pp=1, cp=1, zero=3, recompute="op", micro_batch_size=2),
        metric="tokens_per_gpu_s", published=tps, family="h200", source="Trainy H200", reference=_TRAINY +
        f", Results table, NUM_NODES {nodes}", stack="torchtitan", fused_elementwise=True,
        dtype="fp8", fp8_recipe="tensorwise",
        note="activation checkpointing as llama3_8b.toml sets it at torchtitan e7c0cae (the file's commit): "
             "mode selective, selective_ac_option op, seq_len 8192; RDMA fabric type not stated (timed as "
             "400 Gb/s RoCE)")
        for nodes, tps in ((4, 10938), (8, 10753))]


# (GPU, model, gpus, global batch, layout, tokens/s/GPU) -- the DGX-H100 and DGX-B200 Llama rows of
# the 25.11 table (FP8-CS); recompute as the recipes (llama3/llama31_workload_base_configs.py) set it;
# "FSDP 0" rows use Megatron's distributed optimizer (ZeRO-1), the recipes' optimizer default
_BRIDGE_ROWS = [
    ("h100-sxm", "llama3-8b", 8, 128, dict(tp=1, pp=1, cp=1, zero=3, virtual_stages=1, recompute="none",
                                           recompute_layers=5, micro_batch_size=1), 14451),
    ("h100-sxm", "llama3-70b", 64, 128, dict(tp=4, pp=8, cp=1, zero=1, virtual_stages=5, recompute="none",
                                             sequence_parallel=1, micro_batch_size=1), 1602),
    ("h100-sxm", "llama3-405b", 1024, 512, dict(tp=8, pp=8, cp=2, zero=1, virtual_stages=8, recompute="none",
                                                sequence_parallel=1, micro_batch_size=1), 292),
    ("b200", "llama3-8b", 8, 128, dict(tp=1, pp=1, cp=1, zero=1, virtual_stages=1, recompute="none",
                                       micro_batch_size=2), 30624),
    ("b200", "llama3-405b", 128, 64, dict(tp=4, pp=8, cp=2, zero=1, virtual_stages=8, recompute="none",
                                          sequence_parallel=1, micro_batch_size=1), 661)]
# the same B200 rows' numbers in parentheses: MXFP8 (the table's footnote: 32 x 32 quantization blocks)
_BRIDGE_MX = {("b200", "llama3-8b"): 29521, ("b200", "llama3-405b"): 624}


# every perf script sets cfg.ddp.grad_reduce_in_fp32 = False (set_*_common_configs): Megatron-Core keeps the
# gradients in the parameters' BF16 (distributed_data_parallel.py: grad_dtype = param.dtype), 2+2+12 bytes
_BRIDGE_PRECISION = "bf16-mixed"


def _bridge_run(gpu: str, model: TransformerConfig, gpus: int, batch: int, layout: dict[str, Any], tps: float,
                dtype: str, recipe: str, system: str, cl: Cluster | None = None, note: str = "") -> PublishedRun:
    """One row of the Megatron-Bridge 25.11 table (Megatron-Core + Transformer Engine)."""
    dp = gpus // (layout["tp"] * layout["pp"] * layout["cp"])
    label = gpu.split("-")[0].upper()
    return PublishedRun(
        name=f"{model.name} {recipe}, {gpus} x {label} (Megatron-Bridge 25.11)", model=model,
        cluster=cl or _dgx(gpu, gpus), global_batch=batch, layout=dict(layout, dp=dp),
        metric="tokens_per_gpu_s", published=tps, family=gpu.split("-")[0], source="Megatron-Bridge",
        reference=_BRIDGE + f" ({system} table, row {model.name}, {recipe})", stack="megatron",
        dtype=dtype, fp8_recipe={"FP8-CS": "current", "FP8-MX": "mxfp8"}.get(recipe, ""), precision=_BRIDGE_PRECISION,
        note=note or "recipe: no recompute except the H100 8B, which recomputes 5 of 32 layers "
                     "(recompute_layers 5); distributed optimizer (ZeRO-1) unless FSDP; TP communication "
                     "overlapped (Transformer Engine userbuffers)")


def _bridge() -> list[PublishedRun]:
    rows = []
    for gpu, preset, gpus, batch, layout, tps in _BRIDGE_ROWS:
        system = "DGX-H100" if gpu == "h100-sxm" else "DGX-B200"
        rows.append(_bridge_run(gpu, get_preset(preset), gpus, batch, layout, tps, "fp8", "FP8-CS", system))
        if (gpu, preset) in _BRIDGE_MX:
            rows.append(_bridge_run(gpu, get_preset(preset), gpus, batch, layout, _BRIDGE_MX[gpu, preset], "fp8",
                                    "FP8-MX", system))
    return rows


# (system, model preset, label, GPUs, GBS, TP, PP, VP, tokens/s/GPU) -- the NVFP4 rows of the 26.04.01 tables
# (FSDP 0, CP 1, MBS 1, seq 8192 in all four)
_BRIDGE_FP4_ROWS = [("DGX-GB300", "llama3-70b", "LLAMA3_70B", 64, 256, 1, 4, 5, 7296),
                    ("DGX-GB200", "llama3-70b", "LLAMA3_70B", 64, 256, 2, 4, 5, 4864),
                    ("DGX-GB300", "llama3-405b", "LLAMA3.1_405B", 256, 1536, 4, 8, 4, 1440),
                    ("DGX-GB200", "llama3-405b", "LLAMA3.1_405B", 256, 1536, 4, 16, 8, 1184)]


def _bridge_nvfp4() -> list[PublishedRun]:
    """Megatron-Bridge 26.04.01's NVFP4 pre-training rows: every transformer layer's linear layers in
    NVFP4 (the performance recipes leave ``first_last_layers_bf16`` False), no TP communication overlap
    (the recipes set ``tp_comm_overlap = False``), BF16 gradient reduction (``grad_reduce_in_fp32 =
    False``, as every Bridge performance recipe). NVL72 racks as the 25.11 rows (:func:`pending_runs`)."""
    rows = []
    for system, preset, label, gpus, batch, tp, pp, vp, tps in _BRIDGE_FP4_ROWS:
        gpu = _SYSTEMS[system]
        cl = _system_cluster(gpu, gpus)
        layout = dict(tp=tp, pp=pp, cp=1, dp=gpus // (tp * pp), zero=1, virtual_stages=vp, micro_batch_size=1,
                      recompute="none", sequence_parallel=int(tp > 1))
        big = preset == "llama3-405b"
        if big:  # as the 25.11 405B rows (_BRIDGE_MEMORY): the recipe balances the pipeline
            layout["account_for_embedding_and_loss"] = True
        rows.append(PublishedRun(
            name=f"{label} NVFP4, {gpus} x {gpu.upper()} (Megatron-Bridge 26.04.01)", model=get_preset(preset),
            cluster=cl, global_batch=batch, layout=layout, metric="tokens_per_gpu_s", published=tps, family=gpu,
            source="Megatron-Bridge NVFP4", reference=_BRIDGE_FP4 + f" ({system} row, {label}, NVFP4)",
            stack="megatron", dtype="nvfp4", precision=_BRIDGE_PRECISION, tp_overlap=0.0,
            note="all transformer layers NVFP4 (bf16_layers 0); distributed optimizer (ZeRO-1, FSDP 0); "
                 "recompute none, as the 25.11 rows of the same tables; NVFP4 parameter all-gather "
                 "(fp4_param_gather) and CUDA graphs not modelled; NVL72 racks as 64-GPU segments"
                 + ("; overlap_param_gather False in the GB200 405B recipe, not modelled (DP overlap one "
                    "fraction)" if big and gpu == "gb200" else "")))
    return rows


def _llama2() -> dict[str, TransformerConfig]:
    """Llama 2 7B (the preset), 13B and 70B as NeMo's Llama2Config13B / Llama2Config70B shape them."""
    llama = get_preset("llama2-7b")
    return {"LLAMA2-7B": llama,
            "LLAMA2-13B": replace(llama, name="llama2-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824,
                                  source=_NEMO + " (Llama2Config13B)"),
            "LLAMA2-70B": replace(llama, name="llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                                  source=_NEMO + " (Llama2Config70B)")}


def _nemo() -> list[PublishedRun]:
    """NeMo 24.07's DGX-H100 pre-training table: FP8, Megatron-Core + Transformer Engine of mid-2024.
    MBS, TP, PP, CP and VP as published; recompute, ZeRO and SP not stated (left to the planner)."""
    gpt3 = get_preset("gpt3-175b")
    shapes = {
        "GPT3-5B": replace(gpt3, name="gpt3-5b", layers=24, hidden=4096, heads=32, kv_heads=32, ffn=16384,
                           source=_NEMO + " (GPTConfig5B; GPT-2 vocabulary of the gpt3-175b preset)"),
        "GPT3-20B": replace(gpt3, name="gpt3-20b", layers=44, hidden=6144, heads=48, kv_heads=48, ffn=24576,
                            source=_NEMO + " (GPTConfig20B; GPT-2 vocabulary of the gpt3-175b preset)"),
        "GPT3-175B": get_preset("gpt3-175b"), **_llama2(),
        "LLAMA3-8B": get_preset("llama3-8b"), "LLAMA3-70B": get_preset("llama3-70b")}
    # (model, GPUs, GBS, MBS, seq, TP, PP, CP, VP, tokens/s/GPU) -- the table's rows, in order (Nemotron
    # rows left out: their vocabulary is not in the text read)
    table = [("GPT3-5B", 64, 2048, 4, 2048, 1, 1, 1, 1, 23406), ("GPT3-20B", 64, 256, 2, 2048, 2, 1, 1, 1, 5851),
             ("GPT3-175B", 128, 256, 1, 2048, 4, 8, 1, 6, 716), ("GPT3-175B", 512, 2048, 2, 2048, 4, 8, 1, 6, 825),
             ("LLAMA2-7B", 8, 128, 1, 4096, 1, 1, 1, 1, 16934), ("LLAMA2-13B", 16, 128, 1, 4096, 1, 4, 1, 10, 8715),
             ("LLAMA2-70B", 64, 128, 1, 4096, 4, 4, 1, 20, 1728), ("LLAMA3-8B", 8, 128, 1, 8192, 1, 1, 2, 1, 12273),
             ("LLAMA3-70B", 64, 128, 1, 8192, 4, 4, 2, 5, 1524)]
    rows = []
    for label, gpus, batch, mbs, seq, tp, pp, cp, vp, tps in table:
        model = replace(shapes[label], seq=seq)
        gpt = label.startswith("GPT")
        rows.append(PublishedRun(
            name=f"{label} FP8, {gpus} x H100 (NeMo 24.07)", model=model, cluster=_dgx("h100-sxm", gpus),
            global_batch=batch, layout=dict(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp), virtual_stages=vp,
                                            micro_batch_size=mbs),
            metric="tokens_per_gpu_s", published=tps, family="h100", source="NeMo 2024",
            reference=_NEMO + f", row {label}, {gpus} GPUs", stack="megatron", dropout=gpt,
            dtype="fp8", precision=_FP32_GRADS,
            note="recompute, distributed optimizer and sequence parallelism not stated (planner's choice); "
                 "FP8 recipe not stated; GPT3 rows keep Megatron's default dropout 0.1, Llama rows none"))
    return rows


def _nemo_long_context() -> list[PublishedRun]:
    """NeMo's long-sequence table on DGX-H100: Llama 2 7B, FP8, 4K to 1M tokens with context
    parallelism; the same NVIDIA source as :func:`_nemo` (one source for leave-one-source-out).
    The B200 table of the same page is left out: its TP x PP x DP x CP is a quarter of its GPU count."""
    rows = []
    # (seq in K, GPUs, batch, TP, PP, DP, CP, TFLOP/s per GPU with CP) -- the table's rows, in order
    for k, gpus, batch, tp, pp, dp, cp, tflops in (
            (4, 4, 1024, 1, 1, 4, 1, 768), (8, 8, 512, 1, 2, 4, 1, 730), (16, 16, 256, 2, 1, 8, 1, 660),
            (32, 32, 128, 2, 1, 8, 2, 610), (64, 64, 64, 4, 1, 8, 2, 574), (128, 128, 32, 4, 1, 8, 4, 555),
            (256, 256, 16, 4, 1, 8, 8, 549), (512, 512, 8, 8, 1, 4, 16, 549), (1024, 1024, 4, 8, 1, 4, 32, 536)):
        rows.append(PublishedRun(
            name=f"LLAMA2-7B FP8 seq {k}K, {gpus} x H100, CP {cp} (NeMo long context)",
            model=replace(get_preset("llama2-7b"), seq=1024 * k), cluster=_dgx("h100-sxm", gpus),
            global_batch=batch, layout=dict(tp=tp, pp=pp, dp=dp, cp=cp), metric="model_tflops_per_gpu",
            published=tflops, family="h100", source="NeMo 2024", reference=_NEMO_LONG + f", row SeqLen {k}K",
            stack="megatron", dtype="fp8", precision=_FP32_GRADS,
            note="micro-batch, recompute, distributed optimizer, SP and interleaving not stated (planner's "
                 "choice); TFLOPS/GPU read as model FLOPs (NeMo's llama2 formula: attention not halved for "
                 "causality, as dtlib's 'full' count)"))
    return rows


# (model, task, GPUs, TP, PP, tokens/s/GPU, model TFLOP/s/GPU) -- the 24.07 'Finetuning' table's rows, in
# order; every row GBS 32, MBS 1, packed sequence length 4096. The model TFLOP/s column is not timed: it
# checks the FLOPs per token (tests/test_plan_validation.py: LoRA ~ 4N, SFT ~ 6N)
NEMO_FINETUNING = [("LLAMA2-7B", "SFT", 8, 1, 1, 16891, 673), ("LLAMA2-13B", "SFT", 8, 1, 4, 10176, 787),
                   ("LLAMA2-70B", "SFT", 16, 4, 4, 1816, 749), ("LLAMA2-7B", "LoRA", 8, 1, 1, 24824, 663),
                   ("LLAMA2-13B", "LoRA", 8, 1, 1, 14629, 757), ("LLAMA2-70B", "LoRA", 8, 2, 4, 2621, 722)]
# NeMo's one LoRA adapter on the fused QKV projection (linear_qkv), in HF PEFT's names (dtlib.analytic.finetune)
NEMO_LORA_TARGETS = ("q_proj", "k_proj", "v_proj")
NEMO_LORA_RANK = 32


def _nemo_finetuning() -> list[PublishedRun]:
    """NeMo 24.07's DGX-H100 fine-tuning table: Llama 2 SFT (every weight) and LoRA (rank 32 on the
    QKV projection: the launcher's ``lora_tuning`` sets ``adapter_dim`` 32 and no ``target_modules``,
    so NeMo's default ``attention_qkv``), FP8, SQuAD v1.1 packed into 4,096-token sequences. A source
    of its own ("NeMo 2024 fine-tuning"): leave-one-source-out then predicts the fine-tuning runs from
    a fit that never saw one. The knobs the table leaves out are the launcher's ``sft.yaml``'s: no
    recompute, no SP, no interleaving, no TP communication overlap, the distributed optimizer."""
    shapes = _llama2()
    rows = []
    for label, task, gpus, tp, pp, tps, _ in NEMO_FINETUNING:
        lora = task == "LoRA"
        rows.append(PublishedRun(
            name=f"{label} {task} FP8, {gpus} x H100 (NeMo 24.07 fine-tuning)", model=shapes[label],
            cluster=_dgx("h100-sxm", gpus), global_batch=32,
            layout=dict(tp=tp, pp=pp, cp=1, dp=gpus // (tp * pp), micro_batch_size=1),
            metric="tokens_per_gpu_s", published=tps, family="h100", source="NeMo 2024 fine-tuning",
            reference=_NEMO_FT + f", row {label} {task}, {gpus} GPUs, TP {tp} PP {pp}", stack="megatron",
            dropout=False, dtype="fp8", finetune="lora" if lora else "full",
            lora_rank=NEMO_LORA_RANK if lora else None, lora_targets=NEMO_LORA_TARGETS if lora else None,
            note="sequences packed to 4,096 tokens of SQuAD samples, timed as 4,096-token sequences: attention "
                 "runs within each sample (Transformer Engine's packed THD format), dtlib counts it over the "
                 "whole 4,096 (too slow by the attention term; packed_doc_length left unset: no citable mean "
                 "token length of the samples as NeMo tokenizes them, docs/validation.md); from the launcher's sft.yaml: recompute none, "
                 "SP off, VP 1 (null), ub_tp_comm_overlap False, distributed_fused_adam (ZeRO 1 here) with "
                 "grad_sync_dtype bf16 (BF16 reduction, the megatron stack's default)"
                 + ("; NeMo's LoRA is one adapter on the fused QKV matrix (A: h x 32, B: 32 x (q + k + v)), "
                    "counted as PEFT's three (q_proj, k_proj, v_proj: two more A's, 2 h r parameters per layer, "
                    "under 0.2% of the FLOPs)" if lora else "; SFT trains every weight (finetune full)")))
    return rows



# (task, system, precision, GPUs, TP, PP, VP, tokens/s/GPU, model TFLOP/s/GPU) -- the 26.06 container's 'SFT
# Performance' and 'LoRA Performance' tables (Model: LLAMA3_70B), in order; every row GBS 32, MBS 1, seq 4096,
# CP 1. The model TFLOP/s column is not timed: it checks the FLOPs per token (tests/test_validation_data.py)
BRIDGE_FINETUNING = [("SFT", "DGX-GB300", "FP8", 32, 1, 2, 20, 4819, 2083),
                     ("SFT", "DGX-GB300", "MXFP8", 32, 1, 2, 20, 4312, 1877),
                     ("SFT", "DGX-GB200", "FP8", 32, 1, 8, 10, 3864, 1671),
                     ("SFT", "DGX-GB200", "MXFP8", 32, 1, 8, 10, 3593, 1553),
                     ("SFT", "DGX-H100", "FP8", 32, 4, 4, 5, 1638, 710),
                     ("LoRA", "DGX-GB300", "FP8", 8, 1, 2, 20, 7481, 2086),
                     ("LoRA", "DGX-GB300", "MXFP8", 8, 1, 2, 20, 7447, 2072),
                     ("LoRA", "DGX-GB200", "FP8", 8, 1, 2, 20, 6206, 1731),
                     ("LoRA", "DGX-GB200", "MXFP8", 8, 1, 4, 20, 5958, 1663),
                     ("LoRA", "DGX-H100", "FP8", 8, 2, 4, 20, 2643, 735)]
# each row's recipe at 067f987: src/megatron/bridge/perf_recipes/llama/<file>, line of its def
_BRIDGE_FT_RECIPES = {
    ("SFT", "DGX-GB300", "FP8"): "gb300/llama3.py:451 llama3_70b_sft_32gpu_gb300_fp8cs_config",
    ("SFT", "DGX-GB300", "MXFP8"): "gb300/llama3.py:654 llama3_70b_sft_32gpu_gb300_fp8mx_config",
    ("SFT", "DGX-GB200", "FP8"): "gb200/llama3.py:542 llama3_70b_sft_32gpu_gb200_fp8cs_config",
    ("SFT", "DGX-GB200", "MXFP8"): "gb200/llama3.py:771 llama3_70b_sft_32gpu_gb200_fp8mx_config",
    ("SFT", "DGX-H100", "FP8"): "h100/llama3.py:343 llama3_70b_sft_32gpu_h100_fp8cs_config",
    ("LoRA", "DGX-GB300", "FP8"): "gb300/llama3.py:555 llama3_70b_peft_8gpu_gb300_fp8cs_config",
    ("LoRA", "DGX-GB300", "MXFP8"): "gb300/llama3.py:605 llama3_70b_peft_8gpu_gb300_fp8mx_config",
    ("LoRA", "DGX-GB200", "FP8"): "gb200/llama3.py:647 llama3_70b_peft_8gpu_gb200_fp8cs_config",
    ("LoRA", "DGX-GB200", "MXFP8"): "gb200/llama3.py:697 llama3_70b_peft_8gpu_gb200_fp8mx_config",
    ("LoRA", "DGX-H100", "FP8"): "h100/llama3.py:451 llama3_70b_peft_8gpu_h100_fp8cs_config"}
# the perf recipes' LoRA: llama3_70b_peft_config's dim 16 (alpha 32; recipes/llama/h100/llama3.py:2608-2609 at
# 067f987) on target_modules ["linear_qkv"]: one adapter on the fused QKV matrix, in HF PEFT's names
BRIDGE_LORA_RANK = 16
_BRIDGE_FT_PRECISION = {"FP8": "current", "MXFP8": "mxfp8"}  # _perf_precision("fp8_cs") / ("fp8_mx")


def _bridge_finetuning() -> list[PublishedRun]:
    """Megatron-Bridge 26.06's Llama 3 70B SFT and LoRA rows on DGX-GB300, DGX-GB200 (one NVL72 rack's
    32 or 8 GPUs) and DGX-H100: SQuAD packed into 4,096-token rows, timed unpacked as
    :func:`_nemo_finetuning` (the FLOPs column gives no sample length: docs/validation.md). "FP8" is
    current scaling (the recipes are the ``*_fp8cs_config`` ones), MXFP8 the MX recipe; BF16 gradient
    reduction and the distributed optimizer, as every Bridge performance recipe; no recompute."""
    rows = []
    for task, system, precision, gpus, tp, pp, vp, tps, _ in BRIDGE_FINETUNING:
        gpu, lora = _SYSTEMS[system], task == "LoRA"
        family = gpu.split("-")[0]
        recipe = _BRIDGE_FT_RECIPES[task, system, precision]
        h100_lora = (system, task) == ("DGX-H100", "LoRA")  # no CUDA graphs, no overlap with the optimizer step
        rows.append(PublishedRun(
            name=f"LLAMA3_70B {task} {precision}, {gpus} x {family.upper()} (Megatron-Bridge 26.06)",
            model=replace(get_preset("llama3-70b"), seq=4096), cluster=_system_cluster(gpu, gpus), global_batch=32,
            layout=dict(tp=tp, pp=pp, cp=1, dp=gpus // (tp * pp), zero=1, virtual_stages=vp, micro_batch_size=1,
                        recompute="none", sequence_parallel=int(tp > 1)),
            metric="tokens_per_gpu_s", published=tps, family=family, source="Megatron-Bridge fine-tuning",
            reference=_BRIDGE_FT + f" ({task} table, row {system} {gpus} GPUs {precision}, TP {tp} PP {pp} VP {vp}; "
                                   f"recipe {recipe})",
            stack="megatron", dtype="fp8", fp8_recipe=_BRIDGE_FT_PRECISION[precision], precision=_BRIDGE_PRECISION,
            finetune="lora" if lora else "full", lora_rank=BRIDGE_LORA_RANK if lora else None,
            lora_targets=NEMO_LORA_TARGETS if lora else None,
            note=f"recipe {recipe}: distributed optimizer (ZeRO-1), grad_reduce_in_fp32 False (BF16 gradients, "
                 "perf_recipes/_common.py:74), FP32 Adam states and recompute none (base config "
                 + ("recipes/llama/h100/llama3.py:2642-2646, 2667" if lora else
                    "recipes/llama/h100/llama3.py:1816-1820, 1840") + "), "
                 + ("SP and TP communication overlap on (the megatron stack's default)" if tp > 1 else "TP 1")
                 + "; SQuAD packed offline into 4,096-token rows, timed as 4,096-token sequences (attention over the "
                 "whole row where the run attends within each sample: too slow by that term; packed_doc_length "
                 "unset: the FLOPs column gives no sample length, docs/validation.md)"
                 + (f"; LoRA rank {BRIDGE_LORA_RANK} on linear_qkv (one adapter on the fused QKV matrix, counted as q_proj, k_proj, "
                    "v_proj)" if lora else "; SFT trains every weight (finetune full)")
                 + ("" if h100_lora else "; not modelled: CUDA graphs (Transformer Engine, scope mlp)")
                 + (", overlap_param_gather_with_optimizer_step" if precision == "FP8" and not h100_lora else "")
                 + ("" if lora else ", defer_embedding_wgrad_compute")))
    return rows

# (container, system, label, preset, GPUs, GBS, MBS, seq, FSDP, TP, PP, CP, VP, EP, tokens/s/GPU) -- the
# tables' rows, in order. Left out: Nemotron-15B and Nemotron-340B (vocabulary not in the text read, as in
# _nemo); the tables of the same pages after the first system (25.02 DGX-H100, 25.04 DGX-B200 and DGX-H100:
# not in the text read); the 25.07 DGX-GB200 table (each cell has a second value in parentheses, with
# another layout, whose meaning is in a footnote not in the text read). Both Mixtral-8x22B rows print GBS 1
# and MBS 64: the two columns swapped (the row's GA 16 = 64 / (1 x DP 4), and the recipe csv: mbs 1, gbs 64).
_NEMO_2025_ROWS = [
    ("25.02", "DGX-B200", "GPT3-175B", "gpt3-175b", 512, 2048, 2, 2048, 0, 4, 4, 1, 6, 1, 1600),
    ("25.02", "DGX-B200", "LLAMA3-8B", "llama3-8b", 8, 128, 2, 8192, 0, 1, 1, 1, 1, 1, 26006),
    ("25.02", "DGX-B200", "LLAMA3-70B", "llama3-70b", 64, 128, 1, 8192, 0, 2, 4, 2, 5, 1, 3062),
    ("25.02", "DGX-B200", "LLAMA3-405B", "llama3-405b", 128, 64, 1, 8192, 0, 4, 8, 2, 8, 1, 625),
    ("25.02", "DGX-B200", "Mixtral-8x7B", "mixtral-8x7b", 64, 256, 2, 4096, 0, 1, 1, 1, 1, 8, 15457),
    ("25.02", "DGX-B200", "Mixtral-8x22B", "mixtral-8x22b", 256, 64, 1, 65536, 0, 2, 4, 8, 14, 8, 2232),
    ("25.04", "DGX-GB200", "GPT3-175B", "gpt3-175b", 128, 256, 2, 2048, 0, 4, 4, 1, 12, 1, 1804),
    ("25.04", "DGX-GB200", "LLAMA3-8B", "llama3-8b", 8, 128, 2, 8192, 0, 1, 1, 1, 1, 1, 33099),
    ("25.04", "DGX-GB200", "LLAMA3-70B", "llama3-70b", 64, 128, 1, 8192, 1, 1, 1, 1, 1, 1, 4035),
    ("25.04", "DGX-GB200", "LLAMA3-405B", "llama3-405b", 128, 64, 1, 8192, 0, 4, 8, 2, 8, 1, 665),
    ("25.04", "DGX-GB200", "Mixtral-8x7B", "mixtral-8x7b", 64, 256, 2, 4096, 0, 1, 1, 1, 1, 8, 19275),
    ("25.04", "DGX-GB200", "Mixtral-8x22B", "mixtral-8x22b", 256, 64, 1, 65536, 0, 2, 4, 8, 14, 8, 2731),
]


def _nemo_2025() -> list[PublishedRun]:
    """NeMo 2.x's 2025 pre-training tables (FP8) on DGX-B200 (NeMo 25.02) and DGX-GB200 (NeMo 25.04):
    a third NVIDIA source, apart from "NeMo 2024" (the 24.03-24.07 containers, H100) and
    "Megatron-Bridge" (the 25.11 container): other releases of NeMo and Megatron-Core, other recipes. Layout as
    published; recompute none, as every matching recipe csv row (recompute_layers 0, no
    recompute_modules); ZeRO-1 (NeMo 2.0's distributed optimizer) unless FSDP 1 (Megatron FSDP,
    ZeRO-3); sequence parallelism with TP (the recipes' performance mode); no dropout (NeMo 2.0's
    GPTConfig175B, Llama3 and Mixtral configs set 0.0). GB200: NVL72 racks as :func:`pending_runs`
    (one NVLink domain of the job's GPUs up to 64; inter-rack 400 Gb/s, not stated)."""
    rows = []
    for container, system, label, preset, gpus, batch, mbs, seq, fsdp, tp, pp, cp, vp, ep, tps in _NEMO_2025_ROWS:
        gpu = _SYSTEMS[system]
        cl = _system_cluster(gpu, gpus)  # GB200 only among the racks: 400 Gb/s between them
        layout = dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=1, dp=gpus // (tp * pp * cp), zero=3 if fsdp else 1,
                      virtual_stages=vp, micro_batch_size=mbs, recompute="none", sequence_parallel=int(tp > 1))
        # 25.04 states its FP8 scaling: "per-tensor FP8 quantization ... scaling factors computed in the
        # current step"; 25.02 says only "FP8 precision" (the stack's default, delayed scaling)
        recipe = "current" if container == "25.04" else ""
        note = ("FP8 recipe not stated (Megatron-Core's delayed scaling assumed); " if not recipe else "")
        note += ("ZeRO-1 (distributed optimizer) unless FSDP 1 (Megatron FSDP = ZeRO-3); recompute none as the "
                 "recipe csv")
        if ep > 1:
            note += ("; MoE: alltoall token dispatcher and aux-loss load balancing (NeMo MixtralConfig), timed as "
                     "balanced routing; ETP 1 (csv etp_size 1 for 8x22B, empty for 8x7B: Megatron-Core's etp = tp = 1)")
        if preset == "mixtral-8x7b":
            note += "; CUDA graphs on in the recipe csv (not timed)"
        if preset == "gpt3-175b":
            note += "; GPT-2 vocabulary of the gpt3-175b preset (NeMo pads it to 50,304)"
        if (container, label) in (("25.04", "LLAMA3-8B"), ("25.04", "LLAMA3-405B")):
            note += "; the r2.3.0 csv (Aug 2025) has another FP8 layout for this model: the table's is taken"
        family = gpu.split("-")[0]
        rows.append(PublishedRun(
            name=f"{label} FP8, {gpus} x {family.upper()} (NeMo {container})",
            model=replace(get_preset(preset), seq=seq), cluster=cl, global_batch=batch, layout=layout,
            metric="tokens_per_gpu_s", published=tps, family=family, source="NeMo 2025",
            reference=_NEMO_2025 + f", table 'Container: NeMo {container}, System: {system}', row {label} "
                                   f"({gpus} GPUs, GBS {batch}, MBS {mbs}, seq {seq}, FSDP {fsdp}, TP {tp}, PP {pp}, "
                                   f"CP {cp}, VP {vp}, EP {ep})",
            stack="megatron", dropout=False, dtype="fp8", fp8_recipe=recipe, precision=_FP32_GRADS, note=note))
    return rows


# (model, seq, GPUs, GPU, MicroBatchSize, GradAccum, GlobalBatchSize, tokens/s/GPU, precision,
#  sharding, activation checkpointing) -- rows of the README's tables as printed
_MPT_ROWS = [
    # H100 80GB BF16 (Large Scale, >= 128 GPUs)
    ("70b", 2048, 512, "h100", 8, 1, 4096, 1007, "bf16", "FULL_SHARD", True),
    ("70b", 2048, 128, "h100", 8, 1, 1024, 1058, "bf16", "FULL_SHARD", True),
    ("30b", 2048, 128, "h100", 8, 1, 1024, 2199, "bf16", "FULL_SHARD", True),
    ("13b", 2048, 128, "h100", 16, 1, 2048, 5080, "bf16", "FULL_SHARD", True),
    ("7b", 2048, 128, "h100", 6, 1, 768, 10475, "bf16", "FULL_SHARD", False),
    ("3b", 2048, 128, "h100", 8, 1, 1024, 23422, "bf16", "SHARD_GRAD_OP", False),
    ("1b", 2048, 128, "h100", 12, 1, 1536, 44123, "bf16", "SHARD_GRAD_OP", False),
    # H100 80GB BF16
    ("13b", 2048, 8, "h100", 2, 1, 16, 4792, "bf16", "FULL_SHARD", False),
    ("7b", 8192, 8, "h100", 8, 2, 128, 6935, "bf16", "FULL_SHARD", True),
    ("1b", 32768, 8, "h100", 1, 4, 32, 12025, "bf16", "FULL_SHARD", False),
    ("3b", 512, 8, "h100", 40, 6, 1920, 27965, "bf16", "FULL_SHARD", False),
    # H100 80GB FP8
    ("3b", 2048, 8, "h100", 10, 6, 480, 30586, "fp8", "FULL_SHARD", False),
    ("1b", 8192, 8, "h100", 2, 4, 64, 32010, "fp8", "FULL_SHARD", False),
    # A100 80GB with 1600 Gbps node-node interconnect (RoCE)
    ("70b", 2048, 64, "a100", 8, 4, 2048, 410, "bf16", "FULL_SHARD", True),
    ("30b", 2048, 8, "a100", 3, 21, 504, 916, "bf16", "FULL_SHARD", True),
    ("13b", 2048, 8, "a100", 2, 3, 48, 2262, "bf16", "FULL_SHARD", False),
    ("7b", 2048, 8, "a100", 6, 2, 96, 4641, "bf16", "FULL_SHARD", False),
    ("1b", 2048, 8, "a100", 14, 4, 448, 20513, "bf16", "FULL_SHARD", False),
]
# mpt-*.yaml: (d_model, n_heads, n_layers)
_MPT_SHAPES = {"1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
               "30b": (7168, 56, 48), "70b": (8192, 64, 80)}


def _mpt() -> list[PublishedRun]:
    """MosaicML's MPT benchmarks: Composer + PyTorch FSDP, eager, FlashAttention (``attn_impl: flash``)."""
    rows = []
    for size, seq, gpus, gpu, mbs, accum, batch, tps, dtype, sharding, checkpointing in _MPT_ROWS:
        hidden, heads, layers = _MPT_SHAPES[size]
        model = TransformerConfig(name=f"mpt-{size}", layers=layers, hidden=hidden, heads=heads, vocab=50368,
                                  seq=seq, ffn=4 * hidden, tied_embeddings=True,
                                  source=_MPT + f" (mpt-{size}.yaml)")
        table = {"h100": "H100 80GB BF16 (Large Scale, >= 128 GPUs)" if gpus >= 128 else
                 "H100 80GB FP8" if dtype == "fp8" else "H100 80GB BF16",
                 "a100": "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"}[gpu]
        rows.append(PublishedRun(
            name=f"MPT-{size.upper()} seq {seq}, {gpus} x {gpu.upper()}, {dtype} (llm-foundry)", model=model,
            cluster=_dgx("a100-80gb", gpus, "ib-hdr") if gpu == "a100" else _dgx("h100-sxm", gpus),
            global_batch=batch, layout=dict(dp=gpus, tp=1, pp=1, cp=1, zero=3 if sharding == "FULL_SHARD" else 2,
                                            recompute="full" if checkpointing else "none", micro_batch_size=mbs),
            metric="tokens_per_gpu_s", published=tps, family=gpu, source="MosaicML llm-foundry",
            reference=_MPT + f", table '{table}', row {size} seq {seq} on {gpus} GPUs (micro-batch {mbs}, "
                             f"grad accum {accum}, {sharding}, activation checkpointing {checkpointing})",
            stack="fsdp", dtype=dtype,
            note="FSDP FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2; eager PyTorch (no torch.compile); "
                 "A100 fabric 8 x 200 Gb/s per node (the table's header; timed with the HDR link), H100 fabric "
                 "not stated (timed with 400 Gb/s NDR per GPU); FP8 recipe not stated"
                 + ("; precision bf16 with FSDP mixed-precision mode PURE (bf16 parameters and gradient "
                    "reduction), timed with dtlib's default bf16/fp32 precision" if (size, gpu) == ("70b", "a100")
                    else "")))
    return rows


def _deepspeed() -> list[PublishedRun]:
    """DeepSpeed on Azure (2022): ZeRO-3 data parallelism, no TP/PP, A100 80GB with 200 Gb/s HDR per GPU.
    Only the rows whose text states GPUs, micro-batch and sequence length are taken."""
    azure = dict(zero=3, tp=1, pp=1, cp=1, sequence_parallel=0, recompute="full")
    rows = []
    for size, layers, hidden, heads, gpus, mbs, seq, tflops, where in (
            ("175B", 96, 12288, 96, 256, 32, 512, 204.49, "Sec. 'Scaling the 175B and 530B models': peak 204.49 "
             "TFLOPs/GPU on 256 GPUs with a micro batch size of 32 and sequence length of 512"),
            ("1T", 128, 25600, 160, 1024, 8, 1024, 165.36, "Sec. 'Scaling the 1T and 2T models': 165.36 TFLOPs/GPU "
             "for micro batch size of 8 across 1024 GPUs (Figure 7: sequence length 1,024)"),
            ("2T", 160, 32768, 128, 1024, 8, 1024, 157, "same section: batch size of 8 per GPU, sequence length "
             "1024, 157 TFLOPs/GPU on 1,024 GPUs")):
        rows.append(PublishedRun(
            name=f"GPT {size} ZeRO-3, {gpus} x A100 (DeepSpeed Azure 2022)",
            model=_gpt(f"gpt-{size.lower()}-ds", layers, hidden, heads, _DEEPSPEED + " Table 2", seq=seq),
            cluster=cluster("a100-80gb", gpus // 8, 8, "nvlink3", "ib-hdr"), global_batch=mbs * gpus,
            # "offloads activations and optimizer states to CPU memory" (the post): ZeRO-Offload of
            # the optimizer and DeepSpeed's cpu_checkpointing of every layer's checkpoint
            layout=dict(azure, dp=gpus, micro_batch_size=mbs, offload="optimizer", activation_offload_layers=layers),
            metric="hardware_tflops_per_gpu",
            published=tflops, family="a100", source="DeepSpeed Azure 2022", reference=_DEEPSPEED + ", " + where,
            stack="deepspeed", convention="korthikanti-2022", fused_elementwise=True,  # Megatron-DeepSpeed GPT
            note="ZeRO-3 without TP/PP is stated for the 530B model only; vocabulary not stated (51,200 as "
                 "Megatron-DeepSpeed's GPT-2 default padding); no gradient accumulation assumed; the post offloads "
                 "activations and optimizer states to CPU memory: counted in memory, not timed (dtlib does not "
                 "time CPU Adam or the PCIe transfers)"))
    return rows


def _llama3() -> list[PublishedRun]:
    """Llama 3 405B pre-training (Meta's own 4D-parallel PyTorch stack; torchtitan mirrors it)."""
    rows = []
    for gpus, cp, seq, tflops, stage in ((8192, 1, 8192, 430, "8K"), (16384, 1, 8192, 400, "8K"),
                                         (16384, 16, 131072, 380, "128K")):
        dp = gpus // (8 * 16 * cp)
        # Sec. 3.3.2: one layer fewer on the first and the last stage, to balance their memory, so
        # that "the first model chunk on the first stage has only the embedding": one layer per
        # chunk, 126 layers + the embedding + the loss over pp 16 x V chunks, V = 8 (derived)
        layout = dict(tp=8, pp=16, cp=cp, dp=dp, account_for_embedding_and_loss=True, virtual_stages=8)
        if seq == 8192:
            layout["recompute"] = "none"  # Sec. 3.3: no activation checkpointing in the 8K stage
        rows.append(PublishedRun(
            name=f"Llama 3 405B, {gpus:,} x H100, seq {seq // 1024}K (Llama 3 T4)",
            model=replace(get_preset("llama3-405b"), seq=seq), cluster=_dgx("h100-sxm", gpus, "roce-400g"),
            global_batch=2 ** 24 // seq, layout=layout, metric="model_tflops_per_gpu", published=tflops,
            family="h100", source="Llama 3 2024", reference=_LLAMA3 + f", row {gpus} GPUs TP 8 CP {cp} PP 16",
            stack="torchtitan", fused_elementwise=True,
            note=f"{stage} stage; Meta's own stack, fused kernels assumed; 16M tokens per batch read as 2^24; BF16; ZeRO stage and micro-batch "
                 "not in the text read (planner's choice); interleaving V = 8 derived from Sec. 3.3.2 (the "
                 "first chunk holds only the embedding: one layer per chunk); TFLOP/s per GPU as Meta counts model "
                 "FLOPs (BF16 MFU 43/41/38% of 989 TFLOP/s)"))
    return rows


# (label, GPU, GPUs, GBS, TP, PP, CP, VP, MBS, EP, ETP, dtype, seconds per step) -- release 25.07's tables, in order
_DGXC_ROWS = [
    ("Llama3.1 405B", "gb200", 128, 64, 4, 8, 2, 8, 1, 1, 1, "bf16", 9.347),
    ("Llama3.1 405B", "gb200", 256, 128, 4, 8, 2, 8, 1, 1, 1, "bf16", 9.484),
    ("Llama3.1 405B", "gb200", 512, 256, 4, 8, 2, 8, 1, 1, 1, "bf16", 9.508),
    ("Llama3.1 405B", "gb200", 128, 64, 4, 8, 2, 8, 1, 1, 1, "fp8", 6.131),
    ("Llama3.1 405B", "gb200", 256, 128, 4, 8, 2, 8, 1, 1, 1, "fp8", 6.183),
    ("Llama3.1 405B", "gb200", 512, 256, 4, 8, 2, 8, 1, 1, 1, "fp8", 6.244),
    ("Llama3.1 405B", "h100-sxm", 512, 256, 8, 8, 2, 8, 1, 1, 1, "bf16", 19.810),
    ("Llama3.1 405B", "h100-sxm", 512, 256, 8, 8, 2, 8, 1, 1, 1, "fp8", 13.020),
    ("Nemotron4 15B", "h100-sxm", 16, 64, 2, 1, 1, 1, 2, 1, 1, "bf16", 2.746),
    ("Nemotron4 15B", "h100-sxm", 16, 64, 2, 1, 1, 1, 2, 1, 1, "fp8", 1.988),
    ("Nemotron4 340B", "h100-sxm", 256, 64, 8, 8, 1, 12, 1, 1, 1, "bf16", 4.606),
    ("Nemotron4 340B", "h100-sxm", 256, 64, 8, 8, 1, 12, 1, 1, 1, "fp8", 3.107),
    ("Nemotron4 340B", "gb200", 128, 32, 8, 4, 1, 12, 1, 1, 1, "bf16", 2.189),
    ("Nemotron4 340B", "gb200", 256, 64, 8, 4, 1, 12, 1, 1, 1, "bf16", 2.19),
    ("Nemotron4 340B", "gb200", 512, 128, 8, 4, 1, 12, 1, 1, 1, "bf16", 2.229),
    ("Nemotron4 340B", "gb200", 128, 32, 8, 4, 1, 12, 1, 1, 1, "fp8", 1.483),
    ("Nemotron4 340B", "gb200", 256, 64, 8, 4, 1, 12, 1, 1, 1, "fp8", 1.517),
    ("Nemotron4 340B", "gb200", 512, 128, 8, 4, 1, 12, 1, 1, 1, "fp8", 1.549),
    ("Nemotron4 340B", "gb200", 128, 512, 8, 4, 1, 12, 1, 1, 1, "bf16", 32.66),
    ("Nemotron4 340B", "gb200", 256, 512, 8, 4, 1, 12, 1, 1, 1, "bf16", 16.58),
    ("Nemotron4 340B", "gb200", 512, 512, 8, 4, 1, 12, 1, 1, 1, "bf16", 8.468),
    ("Nemotron4 340B", "gb200", 128, 512, 8, 4, 1, 12, 1, 1, 1, "fp8", 21.83),
    ("Nemotron4 340B", "gb200", 256, 512, 8, 4, 1, 12, 1, 1, 1, "fp8", 11.21),
    ("Nemotron4 340B", "gb200", 512, 512, 8, 4, 1, 12, 1, 1, 1, "fp8", 5.668),
    ("DeepSeek V3", "h100-sxm", 512, 4096, 2, 8, 1, 1, 1, 64, 1, "bf16", 48.948),
    ("DeepSeek V3", "h100-sxm", 1024, 8192, 2, 16, 1, 1, 1, 64, 1, "bf16", 52.04),
    ("DeepSeek V3", "gb200", 128, 1024, 2, 4, 1, 1, 1, 32, 1, "bf16", 34.168),
    ("DeepSeek V3", "gb200", 256, 2048, 2, 4, 1, 1, 1, 64, 1, "bf16", 34.194),
    ("DeepSeek V3", "gb200", 512, 4096, 2, 4, 1, 1, 1, 64, 1, "bf16", 34.274),
    ("Grok1 314B", "gb200", 128, 256, 4, 1, 1, 1, 1, 8, 4, "bf16", 7.325),
    ("Grok1 314B", "gb200", 256, 512, 4, 1, 1, 1, 1, 8, 4, "bf16", 7.39),
    ("Grok1 314B", "gb200", 512, 1024, 4, 1, 1, 1, 1, 8, 4, "bf16", 7.324),
    ("Grok1 314B", "gb200", 128, 256, 4, 1, 1, 1, 1, 8, 4, "fp8", 5.298),
    ("Grok1 314B", "gb200", 256, 512, 4, 1, 1, 1, 1, 8, 4, "fp8", 5.224),
    ("Grok1 314B", "gb200", 512, 1024, 4, 1, 1, 1, 1, 8, 4, "fp8", 5.193),
    ("Grok1 314B", "h100-sxm", 512, 1024, 4, 8, 2, 8, 1, 8, 1, "bf16", 15.933),
    ("Grok1 314B", "h100-sxm", 512, 1024, 4, 8, 2, 8, 1, 8, 1, "fp8", 13.433),
    ("Llama4 Maverick", "gb200", 128, 1024, 1, 2, 1, 12, 1, 64, 1, "bf16", 7.781),
    ("Llama4 Maverick", "gb200", 256, 2048, 1, 2, 1, 12, 1, 64, 1, "bf16", 7.859),
    ("Llama4 Maverick", "gb200", 512, 4096, 1, 2, 1, 12, 1, 64, 1, "bf16", 7.992),
    ("Llama4 Maverick", "gb200", 128, 1024, 1, 2, 1, 12, 1, 64, 1, "fp8", 6.093),
    ("Llama4 Maverick", "gb200", 256, 2048, 1, 2, 1, 12, 1, 64, 1, "fp8", 6.223),
    ("Llama4 Maverick", "gb200", 512, 4096, 1, 2, 1, 12, 1, 64, 1, "fp8", 6.327),
    ("Llama4 Maverick", "h100-sxm", 512, 1024, 4, 1, 1, 1, 1, 128, 4, "bf16", 4.426),
    ("Llama4 Maverick", "h100-sxm", 512, 1024, 4, 1, 1, 1, 1, 128, 4, "fp8", 3.855),
]
# each workload's setup.sh pins the NeMo commit its launch.sh runs (NEMO_COMMIT)
_DGXC_NEMO = {"Llama3.1 405B": "6f2c6fdaffcc0af97a9e2219fcc104e2399627e4",
              "Grok1 314B": "6f2c6fdaffcc0af97a9e2219fcc104e2399627e4",
              "Nemotron4 15B": "b4148d21695de467d50ebf050566555429c26919",
              "Nemotron4 340B": "b4148d21695de467d50ebf050566555429c26919",
              "DeepSeek V3": "7a8f1cc7bc40a84447c0681a9e4e956a135ae8a2",
              "Llama4 Maverick": "7a8f1cc7bc40a84447c0681a9e4e956a135ae8a2"}
_DGXC_README = {"Llama3.1 405B": "llama3.1/README.md", "Nemotron4 15B": "nemotron/README.md",
                "Nemotron4 340B": "nemotron/README.md", "DeepSeek V3": "deepseek_v3/pretraining/README.md",
                "Grok1 314B": "grok1/README.md", "Llama4 Maverick": "llama4/README.md"}


def _dgxc_models() -> dict[str, TransformerConfig]:
    """The models of DGXC's tables as the NeMo code they run shapes them.

    Nemotron-4 15B and 340B from the README's Notes (layers, hidden, FFN, heads, query groups, vocabulary
    256,000, seq 4096): LayerNorm, RoPE, no biases, untied embeddings (NVIDIA 2024, "Nemotron-4 15B
    Technical Report", Sec. 2); its squared-ReLU MLP has two matrices, as the non-gated ``gelu`` one: the
    same GEMMs and one activation kernel. Grok-1 as ``pretrain_grok1_314b.py`` builds it: NeMo's
    ``MixtralConfig8x7B`` (SwiGLU, RMSNorm, RoPE base 1e6, top-2 routing, no biases, untied) with 64 layers,
    hidden 6,144, 48 heads, 8 query groups, FFN 32,768 and 8 experts, and the Llama 3 tokenizer as the
    script's proxy (vocabulary 128,256). Llama 4 Maverick as ``Llama4Experts128Config``
    (``nemo/collections/llm/gpt/model/llama.py``): 48 layers, hidden 5,120, 40 heads, 8 query groups,
    dense FFN 16,384, vocabulary 25,256 x 8, MoE on every second layer (``moe_layer_freq = [0, 1] * 24``:
    the first dense, then every 2nd), 128 experts of 8,192, top-1 with sigmoid scores, one shared expert of
    8,192, RoPE base 500,000. The MoE runs drop tokens at capacity 1.0 and pad to it
    (``MegatronTokenDropCallback``'s defaults), as DeepSeek-V3's do (``USE_TOKEN_DROP``)."""
    nemotron = TransformerConfig(name="nemotron4-15b", layers=32, hidden=6144, heads=48, kv_heads=8, ffn=24576,
                                 vocab=256000, seq=4096, activation="gelu", tied_embeddings=False, bias=False,
                                 norm="layernorm", position="rope", source=_DGXC + " (nemotron/README.md, Notes)")
    grok = TransformerConfig(name="grok1-314b", layers=64, hidden=6144, heads=48, kv_heads=8, ffn=32768,
                             vocab=128256, seq=8192, activation="swiglu", tied_embeddings=False, bias=False,
                             norm="rmsnorm", position="rope", rope_theta=1e6, moe_experts=8, moe_top_k=2,
                             moe_capacity_factor=1.0,
                             source=_DGXC + " (grok1/README.md; NeMo scripts/performance/llm/pretrain_grok1_314b.py "
                                            "at " + _DGXC_NEMO["Grok1 314B"] + ")")
    maverick = TransformerConfig(name="llama4-maverick", layers=48, hidden=5120, heads=40, kv_heads=8, ffn=16384,
                                 vocab=202048, seq=8192, activation="swiglu", tied_embeddings=False, bias=False,
                                 norm="rmsnorm", position="rope", rope_theta=500000.0, moe_experts=128, moe_top_k=1,
                                 moe_ffn=8192, moe_shared_experts=1, moe_dense_layers=1, moe_layer_freq=2,
                                 router_score="sigmoid", moe_capacity_factor=1.0,
                                 source=_DGXC + " (llama4/README.md; NeMo nemo/collections/llm/gpt/model/llama.py "
                                                "Llama4Experts128Config at " + _DGXC_NEMO["Llama4 Maverick"] + ")")
    return {"Nemotron4 15B": nemotron,
            "Nemotron4 340B": replace(nemotron, name="nemotron4-340b", layers=96, hidden=18432, heads=96, ffn=73728),
            "Llama3.1 405B": replace(get_preset("llama3-405b"), seq=8192),
            "DeepSeek V3": replace(get_preset("deepseek-v3"), seq=4096, moe_capacity_factor=1.0),
            "Grok1 314B": grok, "Llama4 Maverick": maverick}


# DeepSeek-V3's attention on Blackwell in the 25.04 containers: MLA's heads are 192 wide for Q and K and
# 128 for V. Transformer Engine's FlashAttention path refuses head_dim_qk != head_dim_v ("does not support
# MLA", get_attention_backend in transformer_engine/pytorch/dot_product_attention/utils.py) and its cuDNN
# fused backend refuses head dims over 128 on sm100 (nvte_get_fused_attn_backend, common/fused_attn/
# fused_attn.cpp: `!(sm_arch_ >= 100 && (head_dim_qk > 128 || head_dim_v > 128))`) until "Add support
# for head_dim > 128" (#1797, 71c76b6, 2025-06-14, first in TE v2.5 of 2025-06-29): the TE NeMo's
# manifest pins at the recipe's commit (bee4649, in v2.2) and any in the 25.04.01 container, older, run
# UnfusedDotProductAttention there. H100 (sm90) has the fused kernel for head dims up to 256. The recipe
# recomputes core_attn on GB200 alone (mla_up_proj on H100), as one does with stored s x s scores.
_DGXC_UNFUSED_MLA = ("Transformer Engine before v2.5 has no fused attention for head dims 192/128 on sm100: "
                     "utils.py 'Disabling FlashAttention as it does not support MLA', fused_attn.cpp head_dim "
                     "<= 128 on sm_arch >= 100, lifted by NVIDIA/TransformerEngine#1797 (71c76b6, v2.5); NeMo's "
                     "manifest at 7a8f1cc pins TE bee4649 (v2.2)")


def _dgxc() -> list[PublishedRun]:
    """NVIDIA's DGX Cloud Benchmarking recipes, release 25.07: NeMo 2.x (25.04 containers) pre-training on
    DGX-H100 and DGX-GB200, step times as measured (iterations 11-44), every row of the six pre-training
    tables of dense and MoE models. Layouts as the tables state them; what they leave out from the NeMo
    code each recipe pins (:data:`_DGXC_NEMO`): the distributed optimizer (ZeRO-1) and sequence parallelism
    with TP (the performance scripts); no recompute (the scripts' ``model_configs_{h100,gb200}.csv`` rows:
    ``recompute_layers`` 0) but DeepSeek-V3's modules (``launch.sh``); BF16 gradient reduction in every
    dense and Grok/Llama 4 run, FP8 and BF16 alike (each recipe's ``pretrain_performance_optimizations``
    sets ``grad_reduce_in_fp32 = False``; the FP8 scripts again with ``bf16_with_fp8_mixed``, delayed
    scaling), FP32 in DeepSeek-V3's (its recipe keeps ``bf16_mixed()``); DeepSeek-V3 with TP communication
    overlap off (``MegatronCommOverlapCallback(tp_comm_overlap=False)`` in its script) and its uneven
    pipeline (``num_layers_in_first_pipeline_stage = 64 / PP - 1``, last ``64 / PP - 2``). GB200: NVL72
    racks as :func:`pending_runs`. Nemotron-H is left out (Mamba layers)."""
    shapes = _dgxc_models()
    rows = []
    for label, gpu, gpus, batch, tp, pp, cp, vp, mbs, ep, etp, dtype, seconds in _DGXC_ROWS:
        family = gpu.split("-")[0]
        layout = dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=gpus // (tp * pp * cp), zero=1, virtual_stages=vp,
                      micro_batch_size=mbs, sequence_parallel=int(tp > 1), recompute="none")
        precision, tp_overlap, flash = "bf16-mixed", None, None
        note = ("ZeRO-1 and SP with TP as NeMo's performance scripts; no recompute (the scripts' csv rows for these "
                "models: recompute_layers 0); BF16 gradient reduction (the recipe's performance mode)")
        if label == "DeepSeek V3":  # launch.sh: RM='mla_up_proj' (H100), 'core_attn' (GB200)
            layout.update(recompute_modules=("core_attn",) if family == "gb200" else ("mla_up_proj",),
                          first_stage_layers=64 // pp - 1, last_stage_layers=64 // pp - 2)
            precision, tp_overlap = _FP32_GRADS, 0.0
            note = ("ZeRO-1 and SP with TP; recompute_modules from launch.sh; ETP 1; TP communication overlap off "
                    f"and {64 // pp - 1} / {64 // pp - 2} layers on the first / last stage (the script); FP32 "
                    "gradient reduction (bf16_mixed); BF16 only (FP8 not supported in this release)")
            if family == "gb200":  # Blackwell: no fused kernel for MLA's head dims in that TE (_DGXC_UNFUSED_MLA)
                flash = False
                note += "; attention unfused (" + _DGXC_UNFUSED_MLA + ")"
        if ep > 1:
            note += ("; alltoall dispatcher, tokens dropped at capacity 1.0 and padded to it (timed as balanced); "
                     "MoE permute fusion not timed")
        if label == "Llama4 Maverick":
            note += "; the shared expert's overlap with the dispatch (moe_shared_expert_overlap) not modelled"
        graphs = label in ("Nemotron4 340B", "Grok1 314B") if family == "gb200" else (label, dtype) == (
            "Llama4 Maverick", "fp8")
        if graphs:
            note += "; CUDA graphs on (launch.sh; not timed)"
        strong = " strong" if label == "Nemotron4 340B" and batch == 512 else ""
        rows.append(PublishedRun(
            name=f"{label} {dtype.upper()}, {gpus} x {family.upper()}{strong} (DGXC 25.07)",
            model=shapes[label], cluster=_system_cluster(gpu, gpus), global_batch=batch, layout=layout,
            metric="step_time_s", published=seconds, family=family, source="DGXC 2025",
            reference=_DGXC + f", {_DGXC_README[label]}, table '{label} {dtype.upper()}', {gpus} GPUs, GBS {batch}; "
                              f"NeMo at {_DGXC_NEMO[label][:10]}",
            stack="megatron", dropout=False, dtype=dtype, fp8_recipe="delayed" if dtype == "fp8" else "",
            precision=precision, tp_overlap=tp_overlap, flash_attention=flash, note=note))
    return rows


def deepseek_v3_runs() -> list[PublishedRun]:
    """DeepSeek-V3's pre-training as its report states it: one row, the throughput implied by 180K
    H800 GPU hours per trillion tokens. Stack ``megatron`` is the nearest (DeepSeek's own HAI-LLM
    framework is not public); DualPipe overlaps the EP all-to-all with the other micro-batch's
    compute (Sec. 3.2.1): ``ep_overlap`` 1, which the step time caps at that compute."""
    return [PublishedRun(
        name="DeepSeek-V3 pre-training, 2,048 x H800 (DeepSeek-V3 report)", model=get_preset("deepseek-v3"),
        cluster=_dgx("h800", 2048), global_batch=15360,
        layout=dict(tp=1, pp=16, cp=1, ep=64, etp=1, dp=128, zero=1, recompute="none", schedule="dualpipe",
                    recompute_modules=("layernorm", "mla_up_proj")),
        metric="tokens_per_gpu_s", published=1e12 / (180_000 * 3600), family="h800", source="DeepSeek-V3 2024",
        reference=_DEEPSEEK_V3 + ", Sec. 1: 180K H800 GPU hours per trillion tokens", stack="megatron",
        dropout=False, dtype="fp8", fp8_recipe="blockwise", ep_overlap=1.0, moe_dispatcher="flex",
        precision=_FP32_GRADS,  # Sec. 3.3.1: "master weights ... and gradients ... are still retained in FP32"
        note="tokens/s/GPU = 1e12 / (180,000 x 3,600 s), an average over the whole pre-training (the batch "
             "ramp included; timed at the final 15,360 sequences); DualPipe as ep_overlap 1.0 (Sec. 3.2.1; its "
             "bidirectional schedule's smaller bubble is not modelled: timed as 1F1B, interleaving left to the "
             "planner); recompute of all RMSNorm and the MLA up-projections (Sec. 3.3.2) as recompute_modules "
             "layernorm and mla_up_proj; fine-grained FP8 (1 x 128 activation tiles, 128 x 128 weight blocks, "
             "Sec. 3.3.2) as the blockwise recipe; its own dispatch kernels (Sec. 3.2.2; DeepEP, their open "
             "release, dispatches topk_weights with x in one kernel) as moe_dispatcher flex; the MTP module "
             "(depth 1), node-limited routing (4 nodes per "
             "token), FP8 activation caching and the 20 SMs kept for communication not modelled; micro-batch "
             "not stated (planner's choice); inter-node IB 50 GB/s per GPU (Sec. 3.2.2) as ib-ndr")]


_CVS = ("AMD, Cluster Validation Suite (ROCm/cvs at dddd914, 2026-08-21): cvs/input/config_file/training/torchtitan/"
        "mi355_llama3_1_8b_single_config.json (seq 8192, FSDP 8, selective activation checkpointing, no compile, "
        "global batch 8, micro-batch 1) and its _threshold.json: 'Based on actual MI355 test results: BF16: 11,767 "
        "TPS, FP8: 11,724 TPS'")


def amd_comparison_runs() -> list[PublishedRun]:
    """The one AMD training measurement found with its layout, kept out of the fit and the goals: a
    note in AMD's own validation suite (:data:`_CVS`), whose files are not consistent enough to be a
    source (the Qwen3 32B config names Qwen/Qwen2.5-32B; the 70B and Mixtral 8x22B notes give the same
    838 TPS; FP8 no faster than BF16). docs/validation.md, "AMD", compares it with the plan."""
    return [PublishedRun(
        name="Llama 3.1 8B, FSDP 8, BF16, 8 x MI355X (AMD CVS, torchtitan)",
        model=replace(get_preset("llama3-8b"), seq=8192),
        cluster=_dgx("mi355x", 8, "roce-400g"), global_batch=8,
        layout=dict(dp=8, tp=1, pp=1, cp=1, zero=3, recompute="op", micro_batch_size=1),
        metric="tokens_per_gpu_s", published=11767, family="mi355x", source="AMD CVS", reference=_CVS,
        stack="torchtitan",
        note="torchtitan's tps (tokens per second per GPU); 'selective' without its option read as the per-op mode "
             "of torchtitan's llama3_8b.toml; one node, so the NIC does not matter")]


_AMD_PRIMUS = ("AMD, ROCm Performance Results (AI training, Primus with the Megatron-LM backend, 8 nodes), 'Measured "
               "8-Node' column as tabulated in AMD-AGI/Primus docs/tech_blogs/projection/projection.md, 'Validation: "
               "Projected vs. Measured Results' (commit 2eb9dc7, 2026-03-25): precision, micro-batch, sequence and "
               "layout per row; Mixtral's global batch from the same page's projection, (128 x 8192) / (5.026 s x 64); "
               "Primus's trainer defaults (primus/configs/modules/megatron/trainer_base.yaml at fd1eeab: "
               "accumulate_allreduce_grads_in_fp32 false) and Mixtral's (mixtral_base.yaml: alltoall dispatcher) "
               "https://github.com/AMD-AGI/Primus/blob/2eb9dc7d5e16acc2b51305798b0b035df9ff9c15/docs/tech_blogs/"
               "projection/projection.md")


def _amd_primus() -> list[PublishedRun]:
    """AMD's own 8-node training measurements (MI325X, MI355X) with the layouts its Primus team published
    beside them. The table's two Llama 3.1 70B rows (FSDP, 'Batch' 4 and 1) are left out: their
    activation recompute is not stated and decides them (the BF16 row +38% without recompute, +5% with
    full recompute), and the Primus configs of the time recompute 72 of 80 layers at other micro-batches."""
    common = dict(metric="tokens_per_gpu_s", source="AMD Primus 2026", stack="megatron", precision="bf16-mixed")
    llama = PublishedRun(
        name="Llama 3.1 8B FP8, DP 64, 64 x MI325X (AMD, Primus)", model=replace(get_preset("llama3-8b"), seq=8192),
        cluster=_dgx("mi325x", 64, "roce-400g"), global_batch=128,
        layout=dict(dp=64, tp=1, pp=1, cp=1, zero=1, recompute="none", micro_batch_size=2), published=16186,
        family="mi325x", reference=_AMD_PRIMUS + " (MI325X table, row Llama 3.1 8B, FP8)", dtype="fp8",
        fp8_recipe="delayed", **common,
        note="FP8 'hybrid' with Megatron's default delayed scaling (Primus's MI325X config); distributed optimizer "
             "(trainer default); global batch not stated: 128 as the Primus MI325X config (the prediction moves "
             "0.3% from 128 to 1,024: gradients reduced once a step, overlapped); NIC not stated (timed as 400 Gb/s "
             "RoCE); 1-node 16,224 tokens/s/GPU in the same table")
    mixtral = PublishedRun(
        name="Mixtral 8x22B BF16, PP 4 VP 2 EP 8, 64 x MI355X (AMD, Primus)",
        model=replace(get_preset("mixtral-8x22b"), seq=8192), cluster=_dgx("mi355x", 64, "roce-400g"),
        global_batch=128, layout=dict(dp=16, tp=1, pp=4, cp=1, ep=8, etp=1, virtual_stages=2, zero=1,
                                      recompute="none", micro_batch_size=2),
        published=3534, family="mi355x", reference=_AMD_PRIMUS + " (MI355X table, row Mixtral 8x22B, BF16)",
        **common,
        note="Primus's mixtral_8x22B_v0.1 (56 layers: 7 per virtual stage), grouped GEMM, alltoall dispatcher, "
             "force-balanced dropless routing (the MI355X config: moe_router_force_load_balancing); no recompute "
             "(recompute_num_layers 0); NIC not stated (timed as 400 Gb/s RoCE)")
    return [llama, mixtral]


def published(include_pending: bool = INCLUDE_PENDING,
              include_deepseek_v3: bool = INCLUDE_DEEPSEEK_V3) -> list[PublishedRun]:
    """Every row, source by source; with ``include_pending`` also :func:`pending_runs`, with
    ``include_deepseek_v3`` also :func:`deepseek_v3_runs`."""
    rows = (_papers_2021_2022() + _torchtitan() + _bridge() + _nemo() + _nemo_long_context() + _nemo_2025() + _mpt()
            + _trainy() + _deepspeed() + _llama3() + _dgxc() + _amd_primus())
    rows += _bridge_nvfp4() + _nemo_finetuning() + _bridge_finetuning()
    rows += deepseek_v3_runs() if include_deepseek_v3 else []
    return rows + pending_runs() if include_pending else rows


# ---- rows that need issue 26's contract names ------------------------------------------------------
# (system, model preset, label, GPUs, precision, GBS, MBS, seq, FSDP, TP, PP, CP, VP, EP, tokens/s/GPU):
# the 25.11 table's rows the planner cannot express today (MoE models; GB300/GB200 racks); the 8B's
# FP8-MX numbers are the ones in parentheses
_BRIDGE_PENDING = [
    ("DGX-GB300", "llama3-8b", "LLAMA3_8B", 8, "FP8-CS", 128, 2, 8192, 0, 1, 1, 1, 1, 1, 37556),
    ("DGX-GB300", "llama3-8b", "LLAMA3_8B", 8, "FP8-MX", 128, 2, 8192, 0, 1, 1, 1, 1, 1, 36108),
    ("DGX-GB300", "llama3-70b", "LLAMA3_70B", 64, "FP8-CS", 256, 2, 8192, 64, 1, 1, 1, 1, 1, 4520),
    ("DGX-GB300", "llama3-405b", "LLAMA3.1_405B", 256, "FP8-CS", 1536, 1, 8192, 0, 2, 8, 2, 4, 1, 999),
    ("DGX-GB300", "deepseek-v3", "DeepSeekV3 (w/o MTP)", 256, "BF16", 4096, 1, 4096, 0, 1, 2, 1, 4, 32, 3848),
    ("DGX-GB300", "deepseek-v3", "DeepSeekV3 (w/o MTP)", 256, "FP8-MX", 4096, 1, 4096, 0, 1, 2, 1, 4, 32, 4357),
    ("DGX-GB300", "gpt-oss-120b", "GPT OSS 120B", 64, "BF16", 1280, 2, 8192, 0, 1, 1, 1, 1, 64, 18347),
    ("DGX-GB300", "qwen3-30b-a3b", "Qwen3_30B_a3B", 8, "FP8-MX", 512, 4, 4096, 0, 1, 1, 1, 1, 8, 28934),
    ("DGX-GB300", "qwen3-235b-a22b", "Qwen3_235B_a22B", 256, "BF16", 8192, 2, 4096, 0, 1, 4, 1, 12, 16, 6131),
    ("DGX-GB200", "llama3-8b", "LLAMA3_8B", 8, "FP8-CS", 128, 2, 8192, 0, 1, 1, 1, 1, 1, 31508),
    ("DGX-GB200", "llama3-8b", "LLAMA3_8B", 8, "FP8-MX", 128, 2, 8192, 0, 1, 1, 1, 1, 1, 29789),
    ("DGX-GB200", "llama3-70b", "LLAMA3_70B", 64, "FP8-CS", 256, 2, 8192, 64, 1, 1, 1, 1, 1, 4312),
    ("DGX-GB200", "llama3-405b", "LLAMA3.1_405B", 256, "FP8-CS", 1536, 1, 8192, 0, 4, 16, 1, 4, 1, 813),
    ("DGX-GB200", "deepseek-v3", "DeepSeekV3 (w/o MTP)", 256, "BF16", 4096, 1, 4096, 0, 1, 4, 1, 4, 64, 3139),
    ("DGX-GB200", "deepseek-v3", "DeepSeekV3 (w/o MTP)", 256, "FP8-MX", 4096, 1, 4096, 0, 1, 8, 1, 4, 32, 4018),
    ("DGX-GB200", "gpt-oss-120b", "GPT OSS 120B", 64, "BF16", 1280, 1, 8192, 0, 1, 1, 1, 1, 64, 15876),
    ("DGX-GB200", "qwen3-30b-a3b", "Qwen3_30B_a3B", 8, "FP8-MX", 512, 4, 4096, 0, 1, 1, 1, 1, 8, 23766),
    ("DGX-GB200", "qwen3-235b-a22b", "Qwen3_235B_a22B", 256, "BF16", 8192, 1, 4096, 0, 1, 8, 1, 3, 32, 4916),
    ("DGX-B200", "deepseek-v3", "DeepSeekV3 (w/ MTP)", 256, "FP8-MX", 2048, 1, 4096, 0, 1, 16, 1, 1, 8, 2139),
    ("DGX-B200", "gpt-oss-120b", "GPT OSS 120B", 64, "BF16", 512, 4, 4096, 0, 1, 1, 1, 1, 8, 8213),
    ("DGX-B200", "qwen3-30b-a3b", "Qwen3_30B_a3B", 8, "FP8-MX", 512, 1, 4096, 0, 1, 1, 1, 1, 8, 9299),
    ("DGX-B200", "qwen3-235b-a22b", "Qwen3_235B_a22B", 64, "FP8-MX", 1024, 1, 4096, 0, 1, 8, 1, 2, 8, 3269),
    ("DGX-H100", "gpt-oss-120b", "GPT OSS 120B", 64, "BF16", 512, 4, 4096, 0, 1, 4, 1, 1, 8, 5630),
    ("DGX-H100", "qwen3-30b-a3b", "Qwen3_30B_a3B", 16, "FP8-CS", 512, 2, 4096, 0, 1, 2, 1, 24, 8, 5275),
    ("DGX-H100", "qwen3-235b-a22b", "Qwen3_235B_a22B", 256, "FP8-CS", 2048, 1, 4096, 0, 2, 8, 1, 4, 32, 1575),
]
# What each MoE row's recipe ran besides its layout (scripts/performance/configs/{qwen3,deepseek,gpt_oss}/
# workload_base_configs.py and *_llm_pretrain.py at the 25.11 summary commit 166d498; docs/moe-steptime.md):
# not timed (no row field yet), kept in the notes. The table's layouts are the runs'; the recipe files give
# other GPU counts or EP for some rows (launched with overrides).
_BRIDGE_MOE_RECIPE = {
    ("DGX-GB300", "deepseek-v3"): "HybridEP flex dispatcher, CUDA graphs attn/moe_router/moe_preprocess, "
                                  "recompute_modules moe_act (recipe file: PP 4, VP 4, EP 64, GBS 2048)",
    ("DGX-GB200", "deepseek-v3"): "HybridEP flex dispatcher, CUDA graphs moe_router/moe_preprocess, "
                                  "recompute_modules mla_up_proj (recipe file: PP 4, VP 4, EP 64)",
    ("DGX-B200", "deepseek-v3"): "alltoall dispatcher, recompute_modules mla_up_proj, pipeline layout with 4 "
                                 "decoder layers per stage and 1 + MTP + loss on the last",
    ("DGX-GB300", "gpt-oss-120b"): "alltoall dispatcher, CUDA graphs attn/moe_router/moe_preprocess",
    ("DGX-GB200", "gpt-oss-120b"): "alltoall dispatcher, recompute_modules layernorm/moe_act",
    ("DGX-B200", "gpt-oss-120b"): "alltoall dispatcher, recompute_modules layernorm/moe_act",
    ("DGX-H100", "gpt-oss-120b"): "alltoall dispatcher, recompute_modules layernorm/moe_act",
    ("DGX-GB300", "qwen3-30b-a3b"): "HybridEP flex dispatcher, CUDA graphs moe_router/moe_preprocess",
    ("DGX-GB200", "qwen3-30b-a3b"): "HybridEP flex dispatcher, CUDA graphs moe_router/moe_preprocess",
    ("DGX-B200", "qwen3-30b-a3b"): "alltoall dispatcher, CUDA graphs moe_router/moe_preprocess",
    ("DGX-H100", "qwen3-30b-a3b"): "alltoall dispatcher, moe_a2a_overlap (recipe file: VP 12, MBS 1)",
    ("DGX-GB300", "qwen3-235b-a22b"): "HybridEP flex dispatcher, CUDA graphs moe_router/moe_preprocess "
                                      "(recipe file: 64 GPUs, EP 64)",
    ("DGX-GB200", "qwen3-235b-a22b"): "HybridEP flex dispatcher, CUDA graphs attn/moe_router/moe_preprocess "
                                      "(recipe file: 64 GPUs, PP 8, EP 8)",
    ("DGX-B200", "qwen3-235b-a22b"): "alltoall dispatcher, moe_a2a_overlap (recipe file: VP 4)",
    ("DGX-H100", "qwen3-235b-a22b"): "alltoall dispatcher, moe_a2a_overlap, no TP communication overlap",
}
# What each pending row's recipe keeps in memory besides its layout (the same files, and
# scripts/performance/utils/helpers.py: set_recompute_overrides, set_megatron_fsdp_overrides): Llama 3 70B
# ran Megatron FSDP with --cpu-offloading-num-layers (LLAMA3_70B_{GB300,GB200}_FP8_CS_BASE_CONFIG: 20 and 40
# layers, cpu_offloading_weights False); Llama 3.1 405B's recipe balances its pipeline
# (llama31_405b_pretrain_config: account_for_{embedding,loss}_in_pipeline_split); the MoE rows recompute the
# modules of _BRIDGE_MOE_RECIPE (DeepSeek-V3: set_deepseek_v3_common_configs sets granularity selective;
# Qwen3: set_qwen3_common_configs sets recompute_granularity None: nothing recomputed).
# what the recipes overlap besides the megatron stack's defaults: moe_a2a_overlap (Megatron's
# --overlap-moe-expert-parallel-comm; the step time caps it at the compute) on the Qwen3 rows that ran it,
# and the H100 Qwen3-235B recipe's tp_comm_overlap=False (_BRIDGE_MOE_RECIPE's notes)
_BRIDGE_OVERLAP = {
    ("DGX-H100", "qwen3-30b-a3b"): dict(ep_overlap=1.0),
    ("DGX-B200", "qwen3-235b-a22b"): dict(ep_overlap=1.0),
    ("DGX-H100", "qwen3-235b-a22b"): dict(ep_overlap=1.0, tp_overlap=0.0),
}
# the rows whose recipe ran the flex dispatcher with HybridEP (moe_token_dispatcher_type="flex",
# moe_flex_dispatcher_backend="hybridep": the GB200/GB300 Qwen3 and DeepSeek-V3 configs of
# workload_base_configs.py at 166d498, _BRIDGE_MOE_RECIPE's notes); the others ran the alltoall dispatcher
_BRIDGE_FLEX = {(system, preset) for system in ("DGX-GB300", "DGX-GB200")
                for preset in ("deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b")}
# The pipeline splits (Megatron-LM accepts an uneven one only through a layout string or the
# first/last-stage flags, dtlib.analytic.layout.split_problem): DeepSeek-V3's 61 layers are placed by
# a --pipeline-model-parallel-layout string (set_deepseek_v3_pipeline_model_parallel_layout,
# recipes/deepseek/deepseek_v3.py), Qwen3-235B's 94 by account_for_{embedding,loss}_in_pipeline_split
# (recipes/qwen/h100/qwen3_moe.py; Megatron-Bridge commit 067f987df)
_BRIDGE_SPLIT = {"deepseek-v3": dict(pipeline_layout=True), "qwen3-235b-a22b": dict(account_for_embedding_and_loss=True)}
_BRIDGE_MEMORY = {
    ("DGX-GB300", "llama3-70b"): dict(activation_offload_layers=20),
    ("DGX-GB200", "llama3-70b"): dict(activation_offload_layers=40),
    ("DGX-GB300", "llama3-405b"): dict(account_for_embedding_and_loss=True),
    ("DGX-GB200", "llama3-405b"): dict(account_for_embedding_and_loss=True),
    ("DGX-GB300", "deepseek-v3"): dict(recompute_modules=("moe_act",)),
    ("DGX-GB200", "deepseek-v3"): dict(recompute_modules=("mla_up_proj",)),
    ("DGX-B200", "deepseek-v3"): dict(recompute_modules=("mla_up_proj",)),
    ("DGX-GB200", "gpt-oss-120b"): dict(recompute_modules=("layernorm", "moe_act")),
    ("DGX-B200", "gpt-oss-120b"): dict(recompute_modules=("layernorm", "moe_act")),
    ("DGX-H100", "gpt-oss-120b"): dict(recompute_modules=("layernorm", "moe_act")),
}
# where a table row is contradicted by the table's own numbers, the recipe file at the summary's commit
# decides, with the contradiction in the row's note. Its own columns: the H100 GPT-OSS row's MBS 4 at PP 4
# (DP 16) gives 512 / (4 x 16) = 8 micro-batches, but its GA column says 2; the 25.11 recipe
# (GPT_OSS_120B_H100_BF16_BASE_CONFIG, which keeps BASE_GPT_OSS_120B_CONFIG's micro_batch_size=1) runs MBS 1.
# The same summary's later releases, which measured both settings on the same system: the B200 GPT-OSS row
# prints EP 8, its recipe (GPT_OSS_120B_B200_BF16_BASE_CONFIG) EP 64; the 26.02 container's table runs the
# model on the same 64 DGX-B200 at MBS 4 and seq 4096 (GBS 1280 there, 512 here: with EP 64 no expert
# gradients are reduced, so the batch hardly matters) at EP 64 at 8,047 tokens/s/GPU, and from 26.02.01 on
# at EP 8 at 13,045-13,722 (docs/performance-summary-archive.md at 067f987): the row's 8,213 is the EP-64
# number, as its recipe has it. Rows whose numbers nothing contradicts keep them, even where their recipe
# file differs.
_BRIDGE_RECIPE_OVER_TABLE = {
    ("DGX-H100", "gpt-oss-120b"): (dict(micro_batch_size=1), "the table's MBS 4 contradicts its own GA column"),
    ("DGX-B200", "gpt-oss-120b"): (dict(ep=64), "the table's EP 8 runs 13,045-13,722 tokens/s/GPU on the same "
                                                "64 DGX-B200 from the 26.02.01 summary on, EP 64 8,047 (26.02): "
                                                "this row's 8,213 is the recipe's EP 64"),
}
_SYSTEMS = {"DGX-GB300": "gb300", "DGX-GB200": "gb200", "DGX-B200": "b200", "DGX-H100": "h100-sxm"}


def pending_runs() -> list[PublishedRun]:
    """The Megatron-Bridge 25.11 rows that need the contract's names (MoE presets, ``gb200``/``gb300``,
    ``ep``/``etp`` layouts). Raises ValueError naming the first missing preset or GPU: nothing is
    skipped silently. NVL72 racks: one NVLink domain of the job's GPUs up to 64 per rack (the
    table does not say how the 256 GPUs sit in 72-GPU racks; 4 x 64 assumed); inter-rack NIC
    400 Gb/s (GB200) / 800 Gb/s (GB300), not stated in the table."""
    rows = []
    for system, preset, label, gpus, recipe, batch, mbs, seq, fsdp, tp, pp, cp, vp, ep, tps in _BRIDGE_PENDING:
        gpu = _SYSTEMS[system]
        model = replace(get_preset(preset), seq=seq)
        cl = _system_cluster(gpu, gpus)
        layout = dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=1, zero=3 if fsdp else 1, virtual_stages=vp,
                      micro_batch_size=mbs, recompute="none", sequence_parallel=int(tp > 1),
                      **_BRIDGE_MEMORY.get((system, preset), {}), **_BRIDGE_SPLIT.get(preset, {}))
        over_table, contradiction = _BRIDGE_RECIPE_OVER_TABLE.get((system, preset), ({}, ""))
        layout.update(over_table)
        moe = ep > 1 or model.moe_experts > 0
        note = ("MoE: ETP 1 (recipes' BASE config), token-dropless with force-balanced routing (the table's "
                "footnote); recompute_modules of the recipe in the layout (memory)" if moe else
                "FSDP 64 = Megatron FSDP (ZeRO-3)" if fsdp else "distributed optimizer (ZeRO-1)")
        if (system, preset) in _BRIDGE_MOE_RECIPE:
            note += "; recipe: " + _BRIDGE_MOE_RECIPE[system, preset]
        if over_table:
            note += f"; {contradiction}, so the recipe file's {over_table} is timed"
        if "w/ MTP" in label:
            note += "; with the multi-token-prediction layer, which dtlib does not model"
        run = _bridge_run(gpu, model, gpus, batch, layout, tps, "bf16" if recipe == "BF16" else "fp8", recipe,
                          system, cl=cl, note=note)
        if (system, preset) in _BRIDGE_FLEX:
            run = replace(run, moe_dispatcher="flex")
        rows.append(replace(run, **_BRIDGE_OVERLAP.get((system, preset), {}),
                            name=f"{label} {recipe}, {gpus} x {gpu.split('-')[0].upper()} (Megatron-Bridge 25.11)"))
    return rows


PUBLISHED: list[PublishedRun] = published()
SOURCES: tuple[str, ...] = tuple(dict.fromkeys(r.source for r in PUBLISHED))
