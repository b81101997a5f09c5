"""The PyTorch backend of the step engine: one model replica, its optimizer, flat gradients.

With reduce_dtype "float64" (the default) each micro-batch's gradient is
added into one float64 buffer, so the sum over the global batch is exact and
its rounding back to the parameters' dtype does not depend on which member
computed which micro-batch (`TrainerConfig.reduce_dtype`). Each parameter's
gradient is added as soon as backward has finished accumulating it (a
post-accumulate-grad hook, `_GradCapture`), while it is still in cache, and
then dropped, so the next micro-batch's backward hands over a fresh gradient
instead of adding into a cleared one. With "native", every parameter's
`.grad` is a view into one flat buffer per dtype: backward accumulates in
place and the all-reduce sums those few large tensors. Either way, `apply`
leaves the mean gradient in `.grad` as views of flat buffers.
"""

from __future__ import annotations

import base64
import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from elastrain.runtime.backend import SkipReason, Update
from elastrain.runtime.compiled import compile_now, eager, is_compiled
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.device import model_device, resolve_reduce_dtype
from elastrain.runtime.preflight import model_problems
from elastrain.runtime.registered import check_registrable
from elastrain.runtime.update import (
    NORM_CHUNK,
    BeforeStep,
    Decision,
    StepGrads,
    all_finite,
    clip,
    grad_norm,
    scheduler_problems,
)
from elastrain.transfer import NamedState, TorchState, model_signature, state_digest
from elastrain.transfer.flatten import Stateful
from elastrain.transfer.names import COMPILE_WRAPPER

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def torch_meta(extra_state: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """A torch member's JSON meta: its global RNG state and the script's extra state."""
    return {
        "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "extra": extra_state() if extra_state else None,
    }


def load_torch_meta(
    meta: dict[str, Any], load_extra_state: Callable[[dict[str, Any]], None] | None
) -> None:
    """Install what `torch_meta` returned on the member that sent or saved it."""
    if meta.get("rng"):
        rng = torch.frombuffer(bytearray(base64.b64decode(meta["rng"])), dtype=torch.uint8)
        torch.set_rng_state(rng)
    if load_extra_state is not None and meta.get("extra") is not None:
        load_extra_state(meta["extra"])


WIDEN_CHUNK = 1 << 16
"""Elements of a micro-batch's gradient converted to float64 at a time (`widen_into`):
512 KiB of float64, so the converted chunk is still in the core's cache when it is
added (a chunk of 1M elements, 8 MiB, went out to memory and back)."""

SMALL_GRAD_ELEMENTS = 1 << 17
"""Parameters with fewer elements are widened together, once per micro-batch
(`_SmallGrads`), not each by its own hook: a hook's Python call and the fresh
gradient it drops cost more than widening 128K elements (a GPT's biases, norms
and small matrices: 29 hooks per micro-batch at the 20 ms benchmark size)."""

KEEP_GRAD_BYTES = 16 << 20
"""Gradients at least this large are kept and cleared after each micro-batch
rather than dropped: glibc serves allocations above its mmap threshold (at most
32 MiB) with fresh pages, which a dropped-and-reallocated gradient would fault
in again on every micro-batch."""


def widen_into(wide: torch.Tensor, grad: torch.Tensor, work: torch.Tensor) -> None:
    """``wide += grad`` (float64 += the gradient's dtype), exactly.

    Converted a chunk at a time into ``work`` (float64, at least `WIDEN_CHUNK`
    elements), then added: torch's mixed-dtype ``add_`` takes a slower,
    element-by-element casting path (about 1.5x the time of these two
    vectorised passes)."""
    flat = grad.reshape(-1)
    for a in range(0, flat.numel(), WIDEN_CHUNK):
        part = flat[a : a + WIDEN_CHUNK]
        x = work[: part.numel()]
        x.copy_(part)
        wide[a : a + part.numel()].add_(x)


class _GradCapture:
    """Adds one parameter's micro-batch gradient into its slice of the float64
    sum (reduce_dtype "float64").

    Registered as the parameter's post-accumulate-grad hook, so it runs on the
    thread running backward, once per backward, after every path into the
    parameter has been accumulated. It acts only while `armed` (inside
    `TorchBackend.compute`): other backward passes (the compile warm-up, FLOP
    counting) leave the gradients alone."""

    def __init__(
        self, param: torch.nn.Parameter, view: torch.Tensor, wide: torch.Tensor, backend: Any
    ) -> None:
        self.param, self.view, self.wide, self.backend = param, view, wide, backend
        self.keep = param.numel() * param.element_size() >= KEEP_GRAD_BYTES
        self.handle = param.register_post_accumulate_grad_hook(self.on_grad)

    def prepare(self) -> None:
        """Before a step's first backward: no gradient (backward then hands over
        its own), or for a kept one its cleared view."""
        if self.keep:
            self.view.zero_()
            self.param.grad = self.view
        else:
            self.param.grad = None

    def on_grad(self, param: torch.Tensor) -> None:
        g = param.grad
        if not self.backend.armed or g is None:
            return
        if g.layout != torch.strided:
            g = g.to_dense()
        widen_into(self.wide, g, self.backend.work(WIDEN_CHUNK))
        if self.keep and g is self.view:
            g.zero_()
        else:
            param.grad = None


class _SmallGrads:
    """The small parameters of one dtype (reduce_dtype "float64"): their .grad are
    views of one contiguous region of the flat gradient buffer, which backward
    accumulates into in place; `widen` adds the region into its slice of the
    float64 sum after each micro-batch's backward and clears it, in one pass
    over all of them (their exact float64 sum is the same as hook by hook: each
    micro-batch's gradient is widened and added alone)."""

    def __init__(
        self, views: list[tuple[torch.nn.Parameter, torch.Tensor]], region: torch.Tensor,
        wide: torch.Tensor,
    ) -> None:  # fmt: skip
        self.views, self.region, self.wide = views, region, wide
        self.offsets: list[int] = []
        off = 0
        for q, _ in views:
            self.offsets.append(off)
            off += q.numel()

    def prepare(self) -> None:
        """Before a step's first backward: cleared views as the .grad (a script's
        ``zero_grad()`` may have set them to None since)."""
        self.region.zero_()
        for q, v in self.views:
            q.grad = v

    def widen(self, work: torch.Tensor) -> None:
        """After a micro-batch's backward: its gradients into the float64 sum."""
        for (q, v), off in zip(self.views, self.offsets, strict=True):
            g = q.grad
            if g is not v:  # replaced during backward (by the script): widen it alone
                if g is not None:
                    dense = g.to_dense() if g.layout != torch.strided else g
                    widen_into(self.wide[off : off + q.numel()], dense, work)
                q.grad = v
        widen_into(self.wide, self.region, work)
        self.region.zero_()


def seed_micro_batch(seed: int, step: int, microbatch: int) -> None:
    """Seed the RNGs for one micro-batch from (job seed, step, micro-batch) alone, so
    that its randomness (dropout, ...) does not depend on which member computes it.

    Seeds the default CPU generator and, where CUDA is in use, every GPU's, like
    ``torch.manual_seed``. That one also queues a lazy seeding for each accelerator
    that is not initialised, recording a Python stack each time: ~0.2 ms a call,
    paid on every micro-batch."""
    s = (seed * 0x9E3779B1 + step * 1_000_003 + microbatch) & 0x7FFF_FFFF_FFFF
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s)


class TorchBackend:
    """`Backend` for a `torch.nn.Module` and a `torch.optim.Optimizer` on this process.

    Who calls: the engine's training thread only; the state-hash thread reads
    the parameters between `begin_step` and `apply` (the engine settles it
    before `apply` writes them).

    ``grad_scaler``: a `torch.amp.GradScaler` the loss is scaled with (fp16
    autocast in the loss function); it is registered as ``"grad_scaler"``.
    ``before_step``: the script's hook (`elastrain.runtime.update.BeforeStep`);
    ``step_index`` then gives it the index of the step being applied.

    ``model`` may be compiled (``torch.compile(model)``, ``model.compile()``, or
    compiled submodules): its state travels under the uncompiled model's names
    (`elastrain.transfer.names`) and it is compiled in `warm_up`.
    """

    framework = "torch"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        extra_state: Callable[[], dict[str, Any]] | None = None,
        load_extra_state: Callable[[dict[str, Any]], None] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        before_step: BeforeStep | None = None,
        step_index: Callable[[], int] | None = None,
    ) -> None:
        if before_step is not None and step_index is None:
            raise ValueError("before_step needs step_index (the index of the step being applied)")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.seed = config.seed
        self.global_batch_size = config.global_batch_size
        self.device = model_device(model.parameters())
        """Where the parameters live, and with them every gradient and reduction
        buffer (`elastrain.runtime.device`)."""
        self.native = resolve_reduce_dtype(config.reduce_dtype, self.device.type) == "native"
        self.max_grad_norm = config.max_grad_norm
        self.extra_state = extra_state
        self.load_extra_state = load_extra_state
        self.objects: dict[str, Stateful] = {}
        """Registered objects, in registration order (the order of their entries)."""
        self.grad_scaler = (
            grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        )
        self.before_step = before_step
        self.step_index = step_index
        if self.grad_scaler is not None:
            self.register("grad_scaler", self.grad_scaler)
        self._extra_slots = 0
        self._flats: list[torch.Tensor] = []
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._ordered: list[torch.Tensor] = []
        """The trainable parameters' .grad views in the model's order (`_grads`)."""
        self._reduce: list[torch.Tensor] = []
        self._scratch = torch.empty(0, dtype=torch.float64, device=self.device)
        """Float64 work space, reused every step (a fresh buffer per step would be
        page-faulted in every time): the widening's conversions and the norm's sums."""
        self._captures: list[_GradCapture] = []
        self._small: list[_SmallGrads] = []
        self._param_ids: list[int] = []
        self.armed = False
        """True while `compute` runs backward: the `_GradCapture` hooks act."""

    # ---- state -------------------------------------------------------------------

    def signature(self) -> list[list[Any]]:
        return model_signature(self.model)

    def state(self) -> TorchState:
        return TorchState(self.model, self.optimizer, self.objects)

    def register(self, name: str, obj: Stateful) -> None:
        """Carry ``obj``'s ``state_dict()`` with the model and optimizer: heal,
        checkpoints and the state hash include it, and a replacement or a resumed
        member gets it through ``load_state_dict``. Every member must register the
        same objects under the same names, before the first step. Raises
        ValueError for a bad or taken name, TypeError for state that cannot travel
        as tensors and JSON."""
        check_registrable(name, obj, self.objects)  # now, not at the first heal
        self.objects[name] = obj

    def adopt(self, state: NamedState) -> None:
        """Nothing to do: `TorchState.install` writes the live model and optimizer."""

    def state_hash(self) -> str:
        return state_digest(self.state())

    def meta(self) -> dict[str, Any]:
        return torch_meta(self.extra_state)

    def load_meta(self, meta: dict[str, Any]) -> None:
        load_torch_meta(meta, self.load_extra_state)

    def count_flops(self, batch: Any, micro_batch: int, global_batch: int) -> dict[str, Any]:
        from elastrain.observe.efficiency import device_info
        from elastrain.observe.flops import measure_step_flops

        # FLOPs are counted op by op as the ops run: a compiled model runs eagerly for it
        # (the module torch.compile wraps, whose calls the counter's module hooks see once).
        model = getattr(self.model, COMPILE_WRAPPER, self.model)
        with eager() if is_compiled(model) else contextlib.nullcontext():
            fc = measure_step_flops(model, self.loss_fn, batch, micro_batch, global_batch)
        return {
            "flops_per_step": fc.flops_per_step,
            "flops_per_microbatch": fc.flops_per_microbatch,
            "flops_per_sample": fc.flops_per_sample,
            "tokens_per_sample": fc.tokens_per_sample,
            "seconds": fc.seconds,
            "method": fc.method,
            **device_info(self.model),
        }

    def problems(self) -> list[str]:
        carries = self.extra_state is not None and self.load_extra_state is not None
        return model_problems(self.model) + scheduler_problems(
            self.optimizer, self.objects, script_carries=carries
        )

    def warm_up(self, batch: Any, extra_slots: int) -> None:
        """Compile a compiled model (`torch.compile(model)` or `model.compile()`) now:
        one micro-batch's forward and backward that leave no trace
        (`elastrain.runtime.compiled`), so that a replacement does not compile
        inside its first step while its peers wait.

        Then build the step's gradient buffers (`_ensure_grad_views`: the flat
        .grad views and, with float64 reductions, the float64 sum: three times the
        bytes of float32 parameters) and the float64 work space, written through, so
        the first step finds them resident. A replacement built them inside its
        first step before, while its peers waited in the all-reduce: fresh memory
        that the VM's host had taken back costs 100-300 ms per 40 MB to fault in
        here (docs/design/heal.md, "A joiner's landing is reserved while it waits").
        Each trainable parameter's .grad is then a zeroed view into them, until
        the first `begin_step` sets the .grads as a step wants them (a parameter
        frozen in between loses its view there)."""
        if is_compiled(self.model):
            compile_now(self.model, self.loss_fn, batch)
        self._ensure_grad_views(extra_slots)
        self.work(NORM_CHUNK).zero_()

    # ---- one step ------------------------------------------------------------------

    def begin_step(self, extra_slots: int) -> None:
        grads, bufs = self._ensure_grad_views(extra_slots)
        if self.native:
            for f in grads:
                f.zero_()
        else:
            bufs[0].zero_()
            for c in self._captures:
                c.prepare()
            for sg in self._small:
                sg.prepare()
        self.model.train()
        if self.grad_scaler is not None:
            # The scaler makes its scale tensor at its first use: a member that computes
            # no micro-batch of this step must have it too, for unscale_ in apply.
            self.grad_scaler.scale(torch.zeros(()))

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            seed_micro_batch(self.seed, step, microbatch)
            loss = self.loss_fn(self.model, batch)
            total = loss * samples
            if self.grad_scaler is not None:
                total = self.grad_scaler.scale(total)
            self.armed = True
            try:
                total.backward()
            finally:
                self.armed = False
            if self._small:
                work = self.work(WIDEN_CHUNK)
                for sg in self._small:
                    sg.widen(work)
        # Not float(loss): that waits for a GPU to finish this micro-batch before the
        # host queues the next one's kernels. float64 keeps the sum what Python's
        # floats made it (the same roundings, in the same order); MPS has no float64.
        value = loss.detach()
        return value.to(torch.float32 if value.device.type == "mps" else torch.float64) * samples

    def reduce_buffers(self) -> list[torch.Tensor]:
        return self._reduce

    def extras(self) -> torch.Tensor:
        return self._reduce[0][-self._extra_slots :]

    def apply(self) -> Update:
        """The mean gradient into ``.grad``, unscaled; its norm; clipping; the
        non-finite skip; the hook; then the optimizer step unless skipped (see
        `elastrain.runtime.update` for why every member decides alike)."""
        if not self.native:
            for q, v in self._views:
                q.grad = v
        self._narrow(self._flats, self._reduce)
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        grads = self._grads()
        norm = grad_norm(grads, self.work(NORM_CHUNK))
        # A finite norm means finite grads; an infinite one may be a float64 overflow.
        finite = not math.isnan(norm) and (not math.isinf(norm) or all_finite(grads))
        skipped = None if finite else SkipReason.NONFINITE
        clipped = False
        params = [q for q, _ in self._views]
        if skipped is None and self.max_grad_norm is not None:
            clipped = clip(params, self.max_grad_norm, norm)
        if self.before_step is not None:
            assert self.step_index is not None
            decision = self.before_step(
                StepGrads(self.step_index(), norm, finite, clipped, params, self.optimizer)
            )
            if skipped is None and decision == Decision.SKIP:
                skipped = SkipReason.HOOK
        if skipped is None:
            if scaler is not None:
                scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        if scaler is not None:
            # The scale backs off after an overflow and grows after enough good steps:
            # the same on every member, which saw the same found-inf.
            scaler.update()
        return Update(norm, skipped)

    def _grads(self) -> list[torch.Tensor]:
        """The mean gradient, each trainable parameter's view in the model's order
        (the order `grad_norm`'s rows are summed in, as the sharded trainer's)."""
        return self._ordered

    def discard(self) -> None:
        self._release_captures()
        self._flats, self._views, self._reduce, self._ordered = [], [], [], []

    def _release_captures(self) -> None:
        for c in self._captures:
            c.handle.remove()
        self._captures, self._small, self._param_ids = [], [], []

    # ---- flat gradient buffers -------------------------------------------------------

    def _ensure_grad_views(self, extra: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(grads, reduce): a flat buffer per dtype with a view per parameter
        (`grads`: the mean gradient lands there in `apply`) and the buffers the
        all-reduce sums (`reduce`), the extras riding at the end of the first.
        With reduce_dtype "native" they are the grad buffers themselves (no copy)
        and every .grad is its view, so backward accumulates in place; with
        "float64" one float64 buffer that each micro-batch's gradient is added
        into: by a `_GradCapture` per large parameter, and for the small ones of
        each dtype, laid out first, by one `_SmallGrads`. Rebuilt when the
        trainable parameters or the extras change (or, native, when something
        replaced a .grad). A parameter no longer trainable (frozen since: by the
        script, or a registered object a heal loaded) loses its view: with a
        .grad left, the optimizer would still step it."""
        params = [q for q in self.model.parameters() if q.requires_grad]
        ids = [id(q) for q in params]
        if (
            self._flats
            and extra == self._extra_slots
            and self._param_ids == ids
            and (
                not self.native
                or all(
                    prm.grad is not None and prm.grad.data_ptr() == v.data_ptr()
                    for prm, v in self._views
                )
            )
        ):
            return self._flats, self._reduce
        for q, v in self._views:
            if not q.requires_grad and q.grad is not None and q.grad.data_ptr() == v.data_ptr():
                q.grad = None
        self._release_captures()
        self._extra_slots = extra
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for q in params:
            by_dtype.setdefault(q.dtype, []).append(q)
        if not self.native:
            # Small parameters first, in their order: one region widened at once.
            for group in by_dtype.values():
                group.sort(key=lambda q: q.numel() >= SMALL_GRAD_ELEMENTS)
        flats: list[torch.Tensor] = []
        grouped: list[list[tuple[torch.nn.Parameter, torch.Tensor]]] = []
        for i, (dtype, group) in enumerate(by_dtype.items()):
            pad = extra if i == 0 and self.native else 0
            flat = torch.zeros(sum(q.numel() for q in group) + pad, dtype=dtype, device=self.device)
            mine = []
            off = 0
            for q in group:
                v = flat[off : off + q.numel()].view_as(q)
                q.grad = v
                mine.append((q, v))
                off += q.numel()
            flats.append(flat)
            grouped.append(mine)
        self._flats, self._views = flats, [qv for mine in grouped for qv in mine]
        view_of = {id(q): v for q, v in self._views}
        self._ordered = [view_of[id(q)] for q in params]
        if self.native:
            self._reduce = flats
        else:
            n = sum(f.numel() for f in flats)
            wide = torch.zeros(n + extra, dtype=torch.float64, device=self.device)
            self._reduce = [wide]
            off = 0  # wide holds each flat's elements in turn, at the same offsets
            for flat, mine in zip(flats, grouped, strict=True):
                small = [(q, v) for q, v in mine if q.numel() < SMALL_GRAD_ELEMENTS]
                n_small = sum(q.numel() for q, _ in small)
                if small:
                    self._small.append(
                        _SmallGrads(small, flat[:n_small], wide[off : off + n_small])
                    )
                off += n_small
                for q, v in mine[len(small) :]:  # the large ones, laid out after
                    self._captures.append(_GradCapture(q, v, wide[off : off + q.numel()], self))
                    off += q.numel()
        self._param_ids = ids
        return self._flats, self._reduce

    def work(self, n: int) -> torch.Tensor:
        """The scratch buffer, at least ``n`` elements (grown once, kept)."""
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float64, device=self.device)
        return self._scratch

    def _narrow(self, grads: list[torch.Tensor], reduce: list[torch.Tensor]) -> None:
        """The summed gradient over the global batch, into the parameters' .grad."""
        b = self.global_batch_size
        if reduce is grads:
            for i, f in enumerate(grads):
                (f[: -self._extra_slots] if i == 0 else f).div_(b)
            return
        wide, off = reduce[0], 0
        for g in grads:
            # One rounding, from the exact float64 mean: same bits on every member.
            g.copy_(wide[off : off + g.numel()].div_(b))
            off += g.numel()
