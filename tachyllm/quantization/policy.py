"""Which linear layers a quantization method touches (`--quant-skip`)."""

from __future__ import annotations

from torch import nn

from tachyllm.errors import ConfigError

# By default the LM head stays in the model dtype: with tied embeddings it shares its weight with
# the embedding table, and it is the layer whose rounding moves the output distribution most.
DEFAULT_SKIP = ("lm_head",)
# Short names accepted by --quant-skip, and the module-name fragment each stands for.
SKIP_ALIASES = {"lm_head": "lm_head", "attn": "self_attn.", "mlp": "mlp."}


def parse_skip(text: str | None) -> tuple[str, ...]:
    """'lm_head,attn' -> ('lm_head', 'attn'); None -> the default; 'none' -> nothing skipped."""
    if text is None:
        return DEFAULT_SKIP
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    return () if items == ("none",) else items


def select_linears(model: nn.Module, skip: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Names of the nn.Linear modules to quantize and of those skipped.

    Each skip item is an alias (lm_head, attn, mlp) or any fragment of a module name
    ('o_proj', 'layers.0.'); an item that matches no linear is an error, not a silent no-op.
    """
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    fragments = {item: SKIP_ALIASES.get(item, item) for item in skip}
    unused = [item for item, frag in fragments.items() if not any(frag in n for n in names)]
    if unused:
        raise ConfigError(
            f"quant_skip item(s) {', '.join(unused)} match no linear layer; accepted: "
            f"{', '.join(SKIP_ALIASES)}, 'none', or a fragment of a layer name such as o_proj or layers.0."
        )
    skipped = [n for n in names if any(frag in n for frag in fragments.values())]
    return [n for n in names if n not in skipped], skipped
