"""Switching an optimization block between an optimizer type and its VR
twin (`lamb` <-> `vr_lamb`), for `vrgd-train --compare` and the sweeps."""

from tf_vrgd.config import OPTIMIZER_TYPES


def vr_twin_type(kind):
    """`lamb` <-> `vr_lamb` and so on; None for types without a twin."""
    if kind.startswith("vr_"):
        return kind[3:] if kind[3:] in OPTIMIZER_TYPES else None
    return f"vr_{kind}" if f"vr_{kind}" in OPTIMIZER_TYPES else None


def twin_block(block):
    """The optimization block with its optimizer switched to the VR twin
    (or back): the type and the key below it are renamed, fields kept
    (fields only the VR type knows are dropped on the way back)."""
    block = dict(block)
    optimizer = dict(block["optimizer"])
    kind = optimizer["type"]
    twin = vr_twin_type(kind)
    if twin is None:
        raise ValueError(
            f"Optimizer type {kind!r} has no VR twin. Twins: "
            f"{sorted(k for k in OPTIMIZER_TYPES if vr_twin_type(k))}"
        )
    fields = dict(optimizer.get(kind) or {})
    if not twin.startswith("vr_"):
        fields = {k: v for k, v in fields.items() if k in OPTIMIZER_TYPES[twin].fields}
    block["optimizer"] = {"type": twin, twin: fields}
    return block
