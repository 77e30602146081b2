"""The forward's warp-specialised schedules (KernelConfig.schedule "overlap" and "pingpong"),
written out explicitly because TileLang 0.1.15's automatic pipeline waits for every wgmma at
once (results/NOTES.md, 83).

A producer warp loads Q once, then K and V into rings `num_stages` deep. Two consumer
warpgroups (64 query rows each; three on 192-row tiles, overlapped only) walk the key
blocks: block k's Q K^T is issued with block k-1's P V behind it; the softmax of block k
runs as soon as its scores are in, while P V still runs on the tensor cores; then O is
rescaled and P cast for the next step (P stays an fp32 tile until then, since the previous P
is the running gemm's operand). With "pingpong" the two warpgroups also take turns issuing
their gemms (named barriers 2 and 3), so that one's exponentials run beside the other's
gemms. (As compiled, ptxas puts the wait for P V right after the row max, so the
exponentials run after it: results/NOTES.md, 89. Holding the wait after them, by retiring
each step at the top of the next, measured 2-9% slower on two warpgroups: NOTES 120, 179.)
On three warpgroups (`retires_next_step`) the unmasked steps do take FlashAttention-3's
order: the step opens by retiring the previous one (its P V waited for, V freed, P cast),
issues Q K^T, rescales O while it runs, then issues P V; ptxas keeps every exponential of
the step before the wait (NOTES 179).

With `KernelConfig.persistent` a grid of one thread block per SM walks the tiles in turn
(TileWalk): the rings keep counting across tiles, the consumers hand Q back once a tile's last
Q K^T is in, and the producer loads the next tile's Q, K and V while they finish this one's
P V and write its O (short rows, such as ViT's, spend most of a tile there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.codegen.rings import parity, ring
from engine.codegen.source import SourceWriter
from engine.kernels.attention_fwd.online import OnlineBody, rescales
from engine.kernels.attention_fwd.plan import o_staged_in_q, retires_next_step
from engine.plan.config import WS_PRODUCER_REGS, WS_PRODUCER_THREADS, KernelConfig

# Named barriers: 1 for the consumers' meeting before the O store, 2 and 3 for the turns.
EPILOGUE_BARRIER = 1
TURN_BARRIERS = (2, 3)


def ws_buffers(cfg: KernelConfig, D: int, Dv: int, dt: str) -> list[str]:
    """Q (also O's staging: o_stage), the K and V rings and their mbarriers: full ones count
    the producer warp's 32 arrivals, empty ones every consumer thread's; persistent, also Q's
    empty barrier and the count of steps walked (each thread's own)."""
    bM, bN, st, C = cfg.block_M, cfg.block_N, cfg.num_stages, cfg.threads
    lines = [f'Q_shared = T.alloc_shared(({bM}, {D}), "{dt}")',
             f'K_shared = T.alloc_shared(({st}, {bN}, {D}), "{dt}")',
             f'V_shared = T.alloc_shared(({st}, {bN}, {Dv}), "{dt}")']
    if not o_staged_in_q(cfg, D, Dv):
        lines.append(f'O_shared = T.alloc_shared(({bM}, {Dv}), "{dt}")')
    lines += [f"q_full = {ring(32, 1)}", f"k_full = {ring(32, st)}",
              f"v_full = {ring(32, st)}", f"k_empty = {ring(C, st)}",
              f"v_empty = {ring(C, st)}"]
    if cfg.persistent:
        lines += [f"q_empty = {ring(C, 1)}", 'cnt = T.alloc_local((1,), "int32")']
    return lines


def o_stage(cfg: KernelConfig, D: int, Dv: int) -> str:
    return "Q_shared" if o_staged_in_q(cfg, D, Dv) else "O_shared"


@dataclass(frozen=True)
class TileWalk:
    """How a thread block meets its tiles: the one its grid position names, or (persistent)
    `trips` of them over `blocks` thread blocks, the it-th numbered `tile` and opened by
    `header` (the lines that name its indices bx, by, bz and its key range lo, n; the
    codegen's walk decides the order). A tile's steps k take ring stage k % stages
    in either case: a persistent tile starts on stage 0 (the rings are padded to whole rounds
    of stages at each tile's end, `emit_padding`), its parities flipped by `ph`, the parity of
    the rounds its block walked before (ptxas spilled with the stage counted on instead)."""

    persistent: bool
    stages: int = 1
    trips: str = ""
    tile: str = ""
    blocks: int = 0
    header: tuple[str, ...] = ()

    def stage(self, step: str) -> str:
        """The ring stage of the tile's `step`."""
        return "0" if step == "0" else f"{step} % {self.stages}"

    def phase(self, step: str) -> str:
        """The mbarrier parity of the tile's `step`."""
        own = "0" if step == "0" else parity(self.stages, step)
        if not self.persistent:
            return own
        return "ph" if step == "0" else f"{own} ^ ph"

    @property
    def q_parity(self) -> str:
        return "(it % 2)" if self.persistent else "0"

    @contextmanager
    def each(self, w: SourceWriter) -> Iterator[None]:
        if not self.persistent:
            yield
            return
        st = self.stages
        with w.block(f"for it in T.serial({self.trips}):"):
            w.lines([f"tile: T.int32 = {self.tile}", *self.header,
                     "c0: T.int32 = cnt[0]", f"ph: T.int32 = (c0 // {st}) % 2"])
            yield
            w.line(f"cnt[0] = c0 + T.ceildiv(n, {st}) * {st}")

    def emit_padding(self, w: SourceWriter, wait: str, arrive: str, flip: str = "") -> None:
        """The tile's ring positions past its last step, to the end of the round: waited on
        `wait` (full or empty) and passed on to `arrive`, both rings, with no load."""
        if not self.persistent or self.stages == 1:
            return
        st = self.stages
        with w.block(f"for k in T.serial(n, T.ceildiv(n, {st}) * {st}):"):
            for ring_name in ("k", "v"):
                w.line(f"T.mbarrier_wait_parity({ring_name}_{wait}[{self.stage('k')}], "
                       f"{self.phase('k')}{flip})")
                w.line(f"T.mbarrier_arrive({ring_name}_{arrive}[{self.stage('k')}])")


@dataclass(frozen=True)
class KeyOrder:
    """The order in which producer and consumers walk a query block's key blocks: [lo, lo + n)
    in turn, or (`full_run`) the run of full blocks [fs, fs + nf) first and then the others
    in turn (the online softmax does not depend on the order)."""

    full_run: bool

    @property
    def first_kb(self) -> str:
        """The key block of step 0 (fs is lo where the run is empty)."""
        return "fs" if self.full_run else "lo"

    def kb(self, j: str) -> str:
        """The key block of step `j`."""
        if not self.full_run:
            return f"lo + {j}"
        return f"T.if_then_else({j} < nf, fs + {j}, {self.rest_kb(j)})"

    @staticmethod
    def rest_kb(j: str) -> str:
        """The key block of step `j` >= nf: the (j - nf)-th block outside the full run.
        Branch-free: TileLang substitutes `kb` into every element of the mask, and a
        conditional there doubled the kernel's code and made ptxas spill (neighbourhood_2d:
        2.2x slower on the H100)."""
        return f"lo + ({j} - nf) + nf * T.Cast(\"int32\", lo + ({j} - nf) >= fs)"


def emit_producer(w: SourceWriter, q_src: str, k_src: str, v_src: str, order: KeyOrder,
                  tiles: TileWalk, key_reads: tuple[tuple[str, str], ...] = (),
                  block_N: int = 0) -> None:
    """Warp 0 of the producer warpgroup: per tile Q (once the consumers have handed the last
    one back), then per step the K and V stages, each once the consumers have freed it.
    `k_src`/`v_src` are slices at key block `kb`; `key_reads` (ring, read of key t of block
    kb): per-key tensors the warp copies into K's stage of their rings before it arrives."""
    stage, phase = tiles.stage("k"), tiles.phase("k")
    with w.block(f"if tx < {WS_PRODUCER_THREADS}:"):
        w.line(f"T.set_max_nreg({WS_PRODUCER_REGS}, 0)")
        with w.block("if tx < 32:"), tiles.each(w):
            if tiles.persistent:
                w.line(f"T.mbarrier_wait_parity(q_empty[0], {tiles.q_parity} ^ 1)")
            w.line(f"T.tma_copy({q_src}, Q_shared, barrier=q_full[0])")
            w.line("T.mbarrier_arrive(q_full[0])")
            with w.block("for k in T.serial(n):"):
                w.line(f"kb: T.int32 = {order.kb('k')}")
                for name, src in (("k", k_src), ("v", v_src)):
                    w.line(f"T.mbarrier_wait_parity({name}_empty[{stage}], {phase} ^ 1)")
                    w.line(f"T.tma_copy({src}, {name.upper()}_shared[{stage}, :, :], "
                           f"barrier={name}_full[{stage}])")
                    if name == "k" and key_reads:
                        with w.block(f"for t in T.Parallel({block_N}):"):
                            w.lines([f"{ring_buf}[{stage}, t] = {read}"
                                     for ring_buf, read in key_reads])
                    w.line(f"T.mbarrier_arrive({name}_full[{stage}])")
            tiles.emit_padding(w, "empty", "full", " ^ 1")


class ConsumerLoop:
    """The consumers' walk over the key blocks [lo, lo + n) at `cfg`. `cls_text`: the block
    class of key block kb (None: every block takes the full body); `tiles`: where the ring
    positions count from, and whether Q and the last V stage go back to the producer;
    `one_block`: no query block sees more than one key block (no loop over the later ones);
    `key_stage`: the bodies read per-key rings at stage `ks`, named with each step's kb."""

    def __init__(self, w: SourceWriter, full: OnlineBody, partial: OnlineBody | None,
                 cls_text: str | None, cfg: KernelConfig, head_dim_v: int, order: KeyOrder,
                 tiles: TileWalk, one_block: bool = False, key_stage: bool = False):
        self.w, self.full, self.partial, self.cls_text = w, full, partial, cls_text
        self.order, self.tiles, self.one_block = order, tiles, one_block
        self.key_stage = key_stage
        self.pingpong, self.consumers = cfg.schedule == "pingpong", cfg.threads
        self.bM, self.Dv = cfg.block_M, head_dim_v
        # registers a thread holds of the score tile and of O (for the operand fences)
        self.tile_regs = cfg.block_M * cfg.block_N // cfg.threads
        self.o_regs = cfg.block_M * head_dim_v // cfg.threads
        # Each step retired at the top of the next (FA3's order): unmasked loops only (with a
        # masked body beside, causal's walk serialised its wgmmas for registers, C7512).
        self.deferred = (retires_next_step(cfg) and partial is None and not order.full_run
                         and full.p_in_acc and not one_block and not key_stage)

    def start(self) -> None:
        """Once per thread block: with ping-pong the first warpgroup takes the first turn."""
        if self.pingpong:
            with self.w.block(f"if tx < {WS_PRODUCER_THREADS + 128}:"):
                self.w.line(f"T.named_barrier_arrive({TURN_BARRIERS[0]}, {self.consumers})")

    def emit(self, qk: Callable[[str], str], pv: Callable[[str], str]) -> None:
        """`qk(stage)`/`pv(stage)`: the gemm statements reading that ring stage."""
        w, last = self.w, "(n - 1)"
        w.line(f"T.mbarrier_wait_parity(q_full[0], {self.tiles.q_parity})")
        with w.block("if n > 0:"):
            w.line(f"kb: T.int32 = {self.order.first_kb}")
            self._key_stage("0")
            self._class()
            w.line(f"T.mbarrier_wait_parity(k_full[{self.tiles.stage('0')}], {self.tiles.phase('0')})")
            with self._turn():
                w.line(qk(self.tiles.stage("0")))
            self._wait_scores(0, self.tiles.stage("0"))
            self._by_class(lambda body: self._body(body, first=True))
            if not self.one_block:
                self._later_blocks(qk, pv)
            self._hand_back_q()  # every Q K^T of the tile is in
            w.line(f"T.mbarrier_wait_parity(v_full[{self.tiles.stage(last)}], {self.tiles.phase(last)})")
            with self._turn():
                w.line(pv(self.tiles.stage(last)))
            self._wait_output()
            if self.tiles.persistent:
                w.line(f"T.mbarrier_arrive(v_empty[{self.tiles.stage(last)}])")
        if self.tiles.persistent:
            with w.block("else:"):
                self._hand_back_q()
        self.tiles.emit_padding(w, "full", "empty")

    def _later_blocks(self, qk: Callable[[str], str], pv: Callable[[str], str]) -> None:
        """Steps 1 .. n - 1: with a full run its blocks first, in a loop of the unmasked body
        alone, then the others by their class."""
        w = self.w
        if self.order.full_run:  # steps 1 .. nf - 1: the full run, the unmasked body
            with w.block("for kk in T.serial(T.max(nf, 1) - 1):"):
                self._steps_head("fs + k", classed=False)
                self._step(self.full, qk, pv)
            loop, kb = "T.serial(T.max(nf, 1) - 1, n - 1)", self.order.rest_kb("k")
        else:
            loop, kb = "T.serial(n - 1)", self.order.kb("k")
        with w.block(f"for kk in {loop}:"):
            self._retire("kk > 0", "(kk - 1)")
            self._steps_head(kb, classed=True)
            self._by_class(lambda body: self._step(body, qk, pv))
        self._retire("n > 1", "(n - 2)", rescale=True)

    def _hand_back_q(self) -> None:
        if self.tiles.persistent:
            self.w.line("T.mbarrier_arrive(q_empty[0])")

    def _steps_head(self, kb: str, classed: bool) -> None:
        """Step k = kk + 1 at key block `kb`: its class read (`classed`), then the waits for
        its K and the previous block's V."""
        self.w.lines(["k: T.int32 = kk + 1", f"kb: T.int32 = {kb}"])
        self._key_stage("k")
        if classed:
            self._class()
        self.w.line(f"T.mbarrier_wait_parity(k_full[{self.tiles.stage('k')}], {self.tiles.phase('k')})")
        self.w.line(f"T.mbarrier_wait_parity(v_full[{self.tiles.stage('kk')}], {self.tiles.phase('kk')})")

    def _key_stage(self, step: str) -> None:
        if self.key_stage:
            self.w.line(f"ks: T.int32 = {self.tiles.stage(step)}")

    def _class(self) -> None:
        # Read ahead of the gemms: a global load at the branch would wait behind them.
        if self.cls_text is not None:
            self.w.line(f'kcls: T.int32 = T.Cast("int32", {self.cls_text})')

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """With ping-pong, one warpgroup's turn at the tensor cores: wait for it, issue the
        gemms, hand it to the other warpgroup."""
        if self.pingpong:
            self._each_warpgroup("T.sync_threads", *TURN_BARRIERS)
        yield
        if self.pingpong:
            self._each_warpgroup("T.named_barrier_arrive", *reversed(TURN_BARRIERS))

    def _each_warpgroup(self, call: str, first: int, second: int) -> None:
        with self.w.block(f"if tx < {WS_PRODUCER_THREADS + 128}:"):
            self.w.line(f"{call}({first}, {self.consumers})")
        with self.w.block("else:"):
            self.w.line(f"{call}({second}, {self.consumers})")

    def _wait_scores(self, pending: int, stage: str) -> None:
        """This block's scores are in (the P V behind them may still run): K's stage is free,
        unless the body still reads the per-key rings filled with it (`_body` frees it)."""
        self.w.line(f"T.wait_wgmma({pending})")
        self.w.line(f"T.warpgroup_fence_operand(acc_s, num_regs={self.tile_regs})")
        if not self.key_stage:
            self.w.line(f"T.mbarrier_arrive(k_empty[{stage}])")

    def _retire(self, after_first: str, v_step: str, rescale: bool = False) -> None:
        """Where steps are deferred: the previous step retired (its P V waited for; V's stage
        of step `v_step` freed `after_first`, the first step has none), O rescaled if
        `rescale` (the last step; the others are rescaled between the next step's gemms),
        its P cast. The wait is unconditional: behind a branch ptxas took O for a running
        gemm's at the rescale and serialised every wgmma (C7514, NOTES 120)."""
        if not self.deferred:
            return
        self._wait_output()
        with self.w.block(f"if {after_first}:"):
            self.w.line(f"T.mbarrier_arrive(v_empty[{self.tiles.stage(v_step)}])")
        if rescale:
            self._rescale(self.full)
        self.w.line("T.copy(acc_s, acc_s_cast)")

    def _rescale(self, body: OnlineBody) -> None:
        if rescales(body.o_scale):
            with self.w.block(f"for i, j in T.Parallel({self.bM}, {self.Dv}):"):
                self.w.line("acc_o[i, j] *= o_scale_f[i]")

    def _wait_output(self) -> None:
        self.w.line("T.wait_wgmma(0)")
        self.w.line(f"T.warpgroup_fence_operand(acc_o, num_regs={self.o_regs})")

    def _by_class(self, emit: Callable[[OnlineBody], None]) -> None:
        """`emit` with the full body, or by the block's class with either. Every branch holds
        a whole pipeline step: a branch taken while a wgmma is in flight makes ptxas wait for
        it at the branch (seen in the SASS: no overlap in either body)."""
        if self.partial is None:
            emit(self.full)
            return
        with self.w.block("if kcls == 2:"):
            emit(self.full)
        with self.w.block("else:"):
            emit(self.partial)

    def _step(self, body: OnlineBody, qk: Callable[[str], str], pv: Callable[[str], str]
              ) -> None:
        """Block k's Q K^T and block k-1's P V issued (deferred: O rescaled between them),
        block k's online step."""
        with self._turn():
            self.w.line(qk(self.tiles.stage("k")))
            if self.deferred:
                self._rescale(self.full)
            self.w.line(pv(self.tiles.stage("kk")))
        self._wait_scores(1, self.tiles.stage("k"))
        self._body(body, first=False)

    def _body(self, body: OnlineBody, first: bool) -> None:
        """The online step, then, once the previous P V is done, V's stage freed, O rescaled
        and P cast for the next gemm; deferred steps: the online step alone (the next step
        retires it), the first's output scale set to 1: the next step rescales O, still 0, by
        it, and an OnlineFunc's first scale need not be finite (0 times inf or NaN is NaN)."""
        w = self.w
        if self.deferred:
            w.line(body.source)
            if first and rescales(body.o_scale):
                with w.block(f"for i in T.Parallel({self.bM}):"):
                    w.line("o_scale_f[i] = T.float32(1.0)")
            return
        serial = not body.p_in_acc  # P written straight into acc_s_cast: the P V must be done
        if serial and not first:
            self._wait_output()
        w.line(body.source)
        if self.key_stage:
            w.line(f"T.mbarrier_arrive(k_empty[{self.tiles.stage('0' if first else 'k')}])")
        if not first:
            if not serial:
                self._wait_output()
            w.line(f"T.mbarrier_arrive(v_empty[{self.tiles.stage('kk')}])")
            self._rescale(body)
        if not serial:
            w.line("T.copy(acc_s, acc_s_cast)")
