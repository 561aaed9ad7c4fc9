"""docs/IR.md, the language reference, generated from the attribute schemas.

``python -m nereus.ir.docs_reference > docs/IR.md``; a test keeps the file in sync.
"""

from .attributes import describe
from .cluster import CLUSTER_ATTRS
from .model import MODEL_ATTRS
from .plan import LAYOUT_ATTRS, PLAN_ATTRS
from .transition import OP_ATTRS, OP_KINDS, TRANSITION_ATTRS
from .workload import STAGE_ATTRS, WORKLOAD_ATTRS

INTRO = (
    """\
# The Nereus IR: language reference

Generated from the attribute schemas by `python -m nereus.ir.docs_reference > docs/IR.md`; the
grammar is `nereus/ir/nereus.lark`. A file is a sequence of declarations:

```
cluster @NAME { ATTRS }
model @NAME { ATTRS }
workload @NAME { ATTRS  stage NAME { ATTRS } ... }
plan @NAME { ATTRS  layout MODEL.STAGE { ATTRS } ... }
emu @PLAN MODEL.STAGE[REPLICAS] { shard [PP, TP] gpus [GPU per replica] { [STATE] TENSOR [SLICE, ...] ... } ... }
transition @NAME { ATTRS  %ID = KIND [STATE] TENSOR [SLICES] from [ENDPOINTS] to [ENDPOINTS] { ATTRS } ... }
```

- Attributes are `key = value`, separated by newlines or commas. `//` comments run to the end
  of the line and are kept by `nereus fmt`.
- Names of declarations (`@actor`) are unique in a file. A model-stage is `MODEL.STAGE`
  (`actor.train`); its layout maps mesh coordinate (dp, pp, tp) to `mesh[(dp * pp_size + pp) * tp_size + tp]`.
- Quantities carry units: sizes `B KB MB GB TB KiB MiB GiB TiB` (whole bytes), bandwidths
  `GB/s` or bits `Gb/s`, times `ns us ms s`, rates `TFLOPs` (= `TFLOP/s`). A quantity's number may
  take an exponent before the unit (`3.35e3GB/s`, printed `3.35TB/s`); other numbers may not.
- Integer lists take inclusive ranges: `[0..7, 12]`. Slices are half-open `start:stop`.
- Tensors are Hugging Face Llama names; per-layer tensors carry their layer or layer range:
  `layers.0..15.mlp.up_proj.weight`. States: weights (default), `grad`, `master`, `exp_avg`,
  `exp_avg_sq`; weights are in the model's dtype, the others in fp32. An operation may name the
  group `optimizer`: the same slice of `master`, `exp_avg` and `exp_avg_sq` at once (its bytes
  are the three's; plan-transition moves a trained model's optimizer state so).
- Endpoints: `MODEL.STAGE[dp, pp, tp]` (sources in the source plan, destinations in the
  target plan) or `host[GPU]`. Operation kinds: """
    + ", ".join(OP_KINDS)
    + """ (below).

"""
)


def _count(lo: int, hi: int | None) -> str:
    return str(lo) if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"


def op_kinds() -> str:
    """The table of operation kinds, from their definitions (``transition.OP_KINDS``)."""
    whose = {"a": "plan A", "b": "plan B", "host": "host[g]", "none": "-"}
    rows = [
        "## operation kinds",
        "",
        "| kind | sources | destinations | reads | writes | what it does |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in OP_KINDS.values():
        writes = whose[k.writes] + (" or host[g] (staged)" if k.stages else "")
        rows.append(
            f"| `{k.name}` | {_count(*k.sources)} | {_count(*k.destinations)} | {whose[k.reads]} | {writes} | {k.doc} |"
        )
    return "\n".join(rows) + "\n"


def reference() -> str:
    parts = [INTRO]
    for title, specs in [
        ("cluster", CLUSTER_ATTRS),
        ("model", MODEL_ATTRS),
        ("workload", WORKLOAD_ATTRS),
        ("stage (inside a workload)", STAGE_ATTRS),
        ("plan", PLAN_ATTRS),
        ("layout (inside a plan)", LAYOUT_ATTRS),
        ("transition", TRANSITION_ATTRS),
        ("operation (inside a transition)", OP_ATTRS),
    ]:
        parts.append(describe(title, specs))
    parts.append(op_kinds())
    parts.append(breakdowns())
    return "\n".join(parts)


def breakdowns() -> str:
    """What ``estimate``'s ``time_breakdown`` and ``memory_breakdown`` hold, component by component
    (``nereus show --breakdown`` prints them)."""
    from .plan import MEMORY_COMPONENTS, TIME_COMPONENTS

    out = [
        "## Breakdowns",
        "",
        "`estimate` writes each layout's time (`time_breakdown`, seconds per step) and peak memory on its fullest "
        "GPU (`memory_breakdown`) by component; `nereus show --breakdown` prints them. Time is costed at the mean "
        "sequence length; memory for the longest micro-batch.",
        "",
        "| time component | what it holds |",
        "| --- | --- |",
        *(f"| `{k}` | {v} |" for k, v in TIME_COMPONENTS.items()),
        "",
        "| memory component | what it holds |",
        "| --- | --- |",
        *(f"| `{k}` | {v} |" for k, v in MEMORY_COMPONENTS.items()),
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(reference(), end="")
