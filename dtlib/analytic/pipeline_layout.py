"""Megatron-LM's ``--pipeline-model-parallel-layout``: a string naming what every pipeline chunk holds.

The grammar, as Megatron-Core core_v0.16.1 reads it (commit 55ac7082517c3878ae653c07c09c534b8aed49f6,
``megatron/core/transformer/pipeline_parallel_layer_layout.py``: ``parse_str_to_list``, ``__init__``,
``validate_layer_layout``; the same file as the megatron-core 0.16.1 wheel):

* one letter per layer: ``E`` the embedding, ``t`` a transformer (decoder) layer, ``m`` a
  multi-token-prediction layer, ``L`` the loss (with the LM head); ``|`` ends a chunk;
* ``x*N`` repeats the letter (or ``|``) before it N times, ``(...)*N`` the text in brackets (brackets
  do not nest); commas are only for reading (``"Et*3|(tt|)*29,m|L"``);
* the chunks are listed virtual stage by virtual stage, each over the pipeline ranks in order (chunk
  ``g`` is rank ``g % pp`` of virtual stage ``g // pp``): their number must be a multiple of ``pp``,
  and ``virtual_stages`` = chunks / pp;
* ``E`` once and first, ``L`` once and last, exactly ``layers`` ``t`` and ``mtp_layers`` ``m``, every
  ``m`` after the last ``t``, all in one chunk of the last virtual stage.

:class:`PipelineLayout` parses and checks a string; its ``decoders`` and ``mtp`` (per chunk) are what
:mod:`dtlib.analytic.stages` places (``tests/test_pipeline_layout.py`` compares the parse with
Megatron-Core's own ``PipelineParallelLayerLayout``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlib.analytic import validate

__all__ = ["PipelineLayout", "LAYER_LETTERS", "expand", "check_alone", "layout_numbers"]

LAYER_LETTERS = {"E": "embedding", "t": "decoder layer", "m": "MTP layer", "L": "loss"}
_GRAMMAR = "letters E t m L, '|' between chunks, x*N and (...)*N repeats (docs/plan.md)"


def _bad(text: str, why: str) -> validate.InvalidArgument:
    return validate.InvalidArgument("pipeline_layout", f"a Megatron layout string ({_GRAMMAR}); {why}", text)


def _repeat_count(text: str, s: str, at: int) -> tuple[int, int]:
    """The N of ``*N`` starting at ``s[at]`` (the ``*``) and the index after it."""
    end = at + 1
    while end < len(s) and s[end].isdigit():
        end += 1
    if end == at + 1:
        raise _bad(text, f"'*' at {at} is not followed by a count")
    return int(s[at + 1:end]), end


def _unroll(text: str, s: str) -> str:
    """``s`` with every ``x*N`` unrolled (no brackets left in ``s``)."""
    out, i = "", 0
    while i < len(s):
        if s[i] == "*":
            if not out:
                raise _bad(text, "'*' has nothing before it to repeat")
            count, i = _repeat_count(text, s, i)
            out = out[:-1] + out[-1] * count
        else:
            out, i = out + s[i], i + 1
    return out


def expand(text: str) -> str:
    """The layout with its repeats written out: ``"(tt|)*2L"`` -> ``"tt|tt|L"``."""
    if not isinstance(text, str):
        raise validate.InvalidArgument("pipeline_layout", f"a Megatron layout string ({_GRAMMAR})", text)
    s, out, i = text.replace(",", ""), "", 0
    while i < len(s):
        if s[i] == "(":
            close = s.find(")", i)
            if close < 0 or "(" in s[i + 1:close]:
                raise _bad(text, "'(' without its ')' (brackets do not nest)")
            if close + 1 >= len(s) or s[close + 1] != "*":
                raise _bad(text, f"'({s[i + 1:close]})' must be followed by *N")
            count, after = _repeat_count(text, s, close + 1)
            out, i = out + _unroll(text, s[i + 1:close]) * count, after
        elif s[i] == ")":
            raise _bad(text, "')' without its '('")
        else:
            # a letter (or '|') and the repeat that may follow it
            stop = i + 1
            while stop < len(s) and s[stop] not in "()":
                stop += 1
            out, i = out + _unroll(text, s[i:stop]), stop
    wrong = sorted(set(out) - set(LAYER_LETTERS) - {"|"})
    if wrong:
        raise _bad(text, f"unknown letter(s) {', '.join(wrong)}")
    return out


@dataclass(frozen=True)
class PipelineLayout:
    """A parsed layout string: ``chunks`` in Megatron's order (virtual stage by virtual stage, ranks
    in order), each the letters it holds."""
    text: str

    @property
    def chunks(self) -> tuple[str, ...]:
        return tuple(expand(self.text).split("|"))

    @property
    def decoders(self) -> tuple[int, ...]:
        """Transformer layers of every chunk."""
        return tuple(c.count("t") for c in self.chunks)

    @property
    def mtp(self) -> tuple[int, ...]:
        """MTP layers of every chunk."""
        return tuple(c.count("m") for c in self.chunks)

    def virtual_stages(self, pp: int) -> int:
        """Chunks per pipeline rank; the chunks must be a multiple of ``pp``."""
        validate.integer("pp", pp)
        chunks = len(self.chunks)
        if chunks % pp:
            raise validate.InvalidArgument(
                "pp", f"a divisor of the layout's {chunks} chunks ({validate.divisors(chunks)}): each rank "
                      f"holds chunks / pp of them", pp)
        return chunks // pp

    def check(self, pp: int, layers: int, mtp_layers: int = 0) -> int:
        """Megatron-Core's checks for a model of ``layers`` transformer and ``mtp_layers`` MTP layers
        on ``pp`` ranks; returns the virtual stages."""
        v = self.virtual_stages(pp)
        flat = "".join(self.chunks)
        if not flat or flat[0] != "E" or flat.count("E") != 1:
            raise _bad(self.text, "the embedding E exactly once, first")
        if flat[-1] != "L" or flat.count("L") != 1:
            raise _bad(self.text, "the loss L exactly once, last")
        if flat.count("t") != layers:
            raise _bad(self.text, f"{layers} transformer layers t (the model's), not {flat.count('t')}")
        if flat.count("m") != mtp_layers:
            raise _bad(self.text, f"{mtp_layers} MTP layers m (the model's mtp_layers, --mtp-layers), not {flat.count('m')}")
        if "m" in flat and "t" in flat[flat.index("m"):]:
            raise _bad(self.text, "every MTP layer m after the last transformer layer t")
        holding = [g for g, c in enumerate(self.chunks) if "m" in c]
        if holding and (len(holding) > 1 or holding[0] // pp != v - 1):
            raise _bad(self.text, "the MTP layers m together in one chunk of the last virtual stage (Megatron-Core)")
        return v


def check_alone(**split_flags: Any) -> None:
    """No other split flag beside a layout string (``first_stage_layers``, ``last_stage_layers``,
    ``account_for_embedding_and_loss``: Megatron-Core ``TransformerConfig.__post_init__``)."""
    for name, value in split_flags.items():
        if value:
            raise validate.InvalidArgument(name, "unset with a pipeline layout string (it places every layer, "
                                                 "the embedding and the loss itself)", value)


def layout_numbers(layout: "PipelineLayout | None") -> dict[str, Any]:
    """What :mod:`dtlib.analytic.stages` reads of an explicit layout: ``layout_decoders`` and
    ``layout_mtp`` (tuples per chunk); nothing without one."""
    if layout is None:
        return {}
    return {"layout_decoders": layout.decoders, "layout_mtp": layout.mtp}
