"""The root's word to its standbys: the trusted senders a heal keeps in reserve.

A heal's root stripes a small state over fewer senders than it trusts
(`elastrain.transfer.manifest.stripe_senders`); the senders its manifest gives
no bytes sit the heal's first pass out and wait for one message from the root,
its `Word`, instead of waking for every round (`elastrain.transfer.striped`,
step 1). Point-to-point over the generation's transport, under `WORD_TAG`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from functools import partial

import torch

from elastrain.transfer.errors import HealError
from elastrain.transfer.rounds import Deadline
from elastrain.transfer.transport import HealTransport


class Word(IntEnum):
    """What the root tells its standbys (the trusted senders its manifest gives no
    bytes, which sit the heal out) once the heal among the other ranks has ended."""

    DONE = 1
    """Every receiver installed the state: a standby's heal is over."""
    RETRY = 2
    """The root's manifest, or a stripe from every sender that took part, was
    refused: every rank runs the heal again, standbys included, without the
    refused senders (marked in the message)."""
    FAILED = 3
    """The heal failed among the others (a rejected manifest, a lost member): a
    standby raises HealError too."""


WORD_TAG = 0
"""The point-to-point tag of the root's word to its standbys: below every tag of
`Among`'s rounds and of the payload."""


def tell(
    tx: HealTransport, standbys: Sequence[int], word: Word, refused: Sequence[int], dl: Deadline
) -> None:
    """Send ``word`` and the refused senders to every standby (on the root)."""
    msg = torch.zeros(1 + tx.size, dtype=torch.int64)
    msg[0] = word
    for r in refused:
        msg[1 + r] = 1
    works = [
        (r, dl.call(partial(tx.send, msg, r, WORD_TAG), f"the word to standby rank {r}"))
        for r in standbys
    ]
    for r, w in works:
        dl.wait(w, f"the word to standby rank {r}")


def hear(tx: HealTransport, root: int, dl: Deadline) -> tuple[Word, list[int]]:
    """A standby's wait for the root's word: the word and the refused senders."""
    msg = torch.zeros(1 + tx.size, dtype=torch.int64)
    what = f"waiting in reserve for the word of the root (rank {root})"
    work = dl.call(lambda: tx.recv(msg, root, WORD_TAG), what)
    dl.wait(work, what)
    got = [int(x) for x in msg.tolist()]
    try:
        word = Word(got[0])
    except ValueError:
        raise HealError(
            f"heal on rank {tx.rank}: the root (rank {root}) sent an unknown word {got[0]}"
        ) from None
    return word, [r for r in range(tx.size) if got[1 + r]]
