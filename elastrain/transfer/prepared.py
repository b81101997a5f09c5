"""A member's share of a heal done ahead: a sender's flatten, layout and (the root's)
digest; a receiver's expected layout and landing.

`PreparedSend` is what a member that knows it will send builds while the
generation's group is being built, `PreparedReceive` what one that knows it will
receive builds then; `Digesting` is the state digest computed on a thread, from
a preparation or, on a root without one, from its manifest's broadcast on.
`elastrain.transfer.striped.heal_over` takes them.
"""

from __future__ import annotations

import threading

from elastrain.threads import HASH, name_native_thread
from elastrain.transfer.auth import HealAuth
from elastrain.transfer.flatten import flat_digest
from elastrain.transfer.landing import Landing, LandingReserve
from elastrain.transfer.manifest import (
    VERSION,
    Expected,
    Manifest,
    Stripe,
    build_manifest,
    encode_entries,
)
from elastrain.transfer.payload import Cut, cut_stripe, plan_receives
from elastrain.transfer.state import FlatState, NamedState


class Digesting:
    """A sender's `state_digest` of its flattened state, computed on a thread (xxhash
    releases the GIL): from a `PreparedSend`'s creation, or on a root without one
    from the moment its manifest is broadcast, so that it overlaps the verdict
    round, the staging and its own stripes' sends but not the manifest's build,
    seal and broadcast, which every rank waits for. Waited for only when the root
    sends it, after its stripes are posted; joined at the end of the heal either way."""

    def __init__(self, flat: FlatState) -> None:
        self._flat = flat
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="elastrain-heal-digest")
        self._thread.start()

    def _run(self) -> None:
        name_native_thread(HASH)
        try:
            self._digest = flat_digest(self._flat)
        except BaseException as e:  # noqa: BLE001 - raised again by result()
            self._error = e

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._digest is not None
        return self._digest

    def join(self) -> None:
        self._thread.join()


class PreparedSend:
    """A sender's share of a heal done before the heal is asked for: its state
    flattened and laid out and, on the root in digest mode, its state digest begun
    on a thread (``root``: the first sender, whose digest the receivers check).

    Why: a sender's flatten and layout check and the root's digest are the part of
    a heal that scales with the state and does not move a byte; begun at the heal
    they delay the manifest rounds (each waits for the slowest sender) and compete
    with the stripes' sends for the cores. A member that knows it will send (the
    generation's plan names it a sender while a peer is behind) prepares while
    the generation's group is being built, which is waiting on peers, and hands
    this to `heal_over`.

    Contract: ``state`` is not written between this call and the heal (the
    engine prepares at a generation's connect and heals right after it, with
    nothing in between that steps). If it were, the digest would not match what
    the stripes carry: the receivers' digest of what landed differs from the
    root's, which is the reference, so the heal fails on every rank (HealError;
    the engine forms the next generation, which prepares afresh) and no receiver
    installs it.
    """

    def __init__(
        self, state: NamedState, auth: HealAuth = HealAuth.DIGEST, *, root: bool = True
    ) -> None:
        self.kind = state.kind
        self.flat: FlatState | None = None
        self.error: TypeError | None = None
        self.layout: Manifest | None = None
        """Its entries laid out (what a sender that is not the root checks the root's
        manifest against, and the root builds its manifest from: `for_heal`; its
        stripes are not this heal's)."""
        self.entries: bytes | None = None
        """The root's `encode_entries` of ``layout`` (most of its manifest's bytes)."""
        self.whole: Cut | None = None
        """The root's whole payload cut into its messages' pieces (`cut_stripe`: views,
        packed at the heal): its stripe when it sends every byte, as a small state's
        root does (`stripe_senders`)."""
        self._digesting: Digesting | None = None
        with state.steady():
            self.limit = state.manifest_limit()
            """Its `NamedState.manifest_limit` (which the root's announcement states before
            anything else: one walk of the model less on every rank's path)."""
            self._prepare(state, auth, root)

    def _prepare(self, state: NamedState, auth: HealAuth, root: bool) -> None:
        try:
            self.flat = state.flatten()
        except TypeError as e:  # the heal raises it as the root's manifest error
            self.error = e
        if self.flat is not None:
            self.layout = build_manifest(
                self.kind, self.flat.tensors, self.flat.section, [0], {}, 0
            )
            if root:
                self.entries = encode_entries(self.layout.entries)
                self.whole = cut_stripe(self.layout, self.flat, self.layout.stripes[0])
                if HealAuth(auth) == HealAuth.DIGEST:
                    self._digesting = Digesting(self.flat)

    def digesting(self) -> Digesting | None:
        """The digest begun at preparation (digest mode), or None. One not used by a
        heal ends on its own: its thread only reads."""
        return self._digesting


class PreparedReceive:
    """A receiver's share of a heal done before the heal is asked for: its manifest
    limit, the layout it expects (`NamedState.expected_layout`, as `Expected`) and
    its landing laid out for that layout (`Landing.allocate`: with ``in_place``
    the state's live targets, the rest in ``reserve``'s memory when given), with
    the receives of the whole payload from one sender planned in it
    (`Landing.planned`: each message and the buffer it lands in).

    Why: before it could post its first receive, a receiver decoded the manifest's
    entries (one JSON object per tensor), judged them (`bound`, `check`), found
    its live targets and cut its landing into one tensor per entry: Python work
    per entry (about 3 ms for the 212 entries of a 39.7 MB model and AdamW on a
    quiet core, 6-8 ms beside the sender's threads), on the path every byte
    waits for; then it planned its 89 messages and their buffers (1.7 ms) while
    the first bytes flowed, on the thread that hashes them. A member that knows
    it will receive (the generation's plan names it) does it while the
    generation's group is being built; at the heal, a manifest whose entries are
    exactly the expected ones (their bytes compared, `decode_expected`) is judged
    on the rest alone and lands here.

    Contract: the state's structure (its tensors, their shapes and dtypes) is not
    changed between this call and the heal, as for `PreparedSend`: the engine
    prepares at a generation's connect and heals right after. A manifest with
    other entries (a prediction that was wrong) is judged whole and lands in
    fresh memory, as without a preparation. Single use: one heal takes it.
    """

    def __init__(
        self, state: NamedState, reserve: LandingReserve | None = None, *, in_place: bool = True
    ) -> None:
        self.kind = state.kind
        self.in_place = in_place
        """Whether ``landing`` lands in the live targets (a heal run otherwise does not use it)."""
        self.expected: Expected | None = None
        """The layout expected, or None (the kind cannot say: nothing laid out ahead)."""
        self.landing: Landing | None = None
        """The landing for ``expected``, or None."""
        with state.steady():
            self.limit = state.manifest_limit()
            """Its `NamedState.manifest_limit`, as `PreparedSend.limit`."""
            try:
                entries = state.expected_layout()
            except (TypeError, ValueError, KeyError):
                entries = None  # a state that cannot travel: the heal says so, not this
            if entries is None:
                return  # the heal lands in ``reserve`` as without a preparation
            self.expected = Expected.of(entries)
            probe = Manifest(VERSION, self.kind, 1, entries, self.expected.total_bytes, (), {}, {})
            live = state.live_targets(probe) if in_place else None
            self.landing = Landing.allocate(entries, reserve, live)
            # The messages of the whole payload from one sender (a state below
            # `STRIPE_MIN_BYTES` comes so), and where each lands.
            whole = Stripe(0, 0, self.expected.total_bytes)
            self.landing.planned[(0, whole.nbytes)] = plan_receives(entries, self.landing, whole)
