"""TracedSpec: everything the executors and code generators need to know about a variant."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from engine.dsl.expr import Expr, custom_names, to_text, topo


@dataclass(frozen=True, eq=False)
class TracedSpec:
    """The IR of one attention variant. Expressions use these leaves:

    score_mod: `score` (raw q.k), indices, customs.  mask: indices, customs (bool; None = no mask).
    online_fwd: `score` (after score_mod), `rowscale.<name>`; outputs p, new row scales, o_scale.
    epilogue: `o` ([m, d] tile), `rowscale.<name>`; outputs o and the final row scales.
    fwd_recompute: `score` (after score_mod), `final.<name>` -> p.
    bwd: `dp`, `p`, `final.<name>`, `doosum` -> d(score after score_mod).
    """

    score_mod: Expr
    mask: Expr | None
    online_init: tuple[tuple[str, float], ...]
    online_p: Expr
    online_updates: tuple[tuple[str, Expr], ...]
    o_scale: Expr
    epilogue_o: Expr
    epilogue_final: tuple[tuple[str, Expr], ...]
    fwd_recompute: Expr
    bwd: Expr
    customs: tuple[tuple[str, tuple], ...]
    final_init: tuple[tuple[str, float], ...] = ()
    online_name: str = ""
    hash: str = field(default="", compare=False)

    # Expressions overload ==, so specs compare by their canonical text.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, TracedSpec) and self.canonical_text() == other.canonical_text()

    def __hash__(self) -> int:
        return hash(self.hash)

    def online_custom_reads(self) -> set[str]:
        """CustomIO names read by the online-function hooks (not differentiable here)."""
        roots = [
            self.online_p,
            self.o_scale,
            self.epilogue_o,
            self.fwd_recompute,
            self.bwd,
            *(e for _, e in self.online_updates),
            *(e for _, e in self.epilogue_final),
        ]
        return custom_names(roots)

    @property
    def online_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.online_init)

    @property
    def final_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.epilogue_final)

    @property
    def custom_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.customs)

    @property
    def uses_doosum(self) -> bool:
        return any(n.op == "doosum" for n in topo([self.bwd]))

    def masked_block_ops(self) -> int:
        """Elementwise ops a partial (masked) block evaluates per score element beyond the
        matmul (0 without a mask). The forward's register model uses it to size tiles
        (engine.kernels.attention_fwd.plan)."""
        return 0 if self.mask is None else self.elementwise_ops()

    def elementwise_ops(self) -> int:
        """The mask's and score_mod's nodes that vary along the key axis: what a block
        evaluates per score element beyond the matmul, masked or not."""
        roots = [self.score_mod] if self.mask is None else [self.mask, self.score_mod]
        return sum(1 for n in topo(roots) if n.args and "n" in n.axes)

    def roots(self) -> dict[str, Expr]:
        out = {
            "score_mod": self.score_mod,
            "online_p": self.online_p,
            "o_scale": self.o_scale,
            "epilogue_o": self.epilogue_o,
            "fwd_recompute": self.fwd_recompute,
            "bwd": self.bwd,
        }
        if self.mask is not None:
            out["mask"] = self.mask
        out.update({f"online_update.{k}": v for k, v in self.online_updates})
        out.update({f"epilogue_final.{k}": v for k, v in self.epilogue_final})
        return out

    def canonical_text(self) -> str:
        lines = [
            f"online_init {self.online_init!r}",
            f"final_init {self.final_init!r}",
            f"customs {self.customs!r}",
        ]
        for name, root in self.roots().items():
            lines.append(f"{name} = {to_text(root)}")
        return "\n".join(lines)

    def describe(self) -> str:
        """A readable listing of the IR (what `mod.ir_text` shows)."""
        return f"# spec {self.hash}\n" + self.canonical_text()


def spec_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
