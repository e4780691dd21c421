"""Slices: bucket and quota capacity a process took from the store ahead of its requests.

A `Grant` is one store acquire (its id is the store's reservation id, journaled so that the crash
recovery of a dead process gives its unused units back); a `SliceBook` holds the grants of every key
and admits from them in memory. The sum of every process's slices is taken through the store's
all-or-nothing acquire, so it never passes a limit: admitting from a slice is as exact as a store
acquire per request.
"""

from __future__ import annotations

import math
from secrets import token_hex

from policies.stores import token_bucket
from policies.stores.base import BucketOp, BucketView, CounterOp

#: a key not used for this long (s) forgets its observed rate and slice size
_IDLE_FORGET_S = 5.0


class Grant:
    """One store acquire of slices: the ops that took them, and what its settle gives back.

    Units are counted per key, not per grant (`KeyState.left`): a request takes its units from the
    key, whichever grant brought them. When the book lets its grants go (a tick, a reload), each
    key's units left are spread over its grants (`back`, `_spread_back`); every grant's settle drops
    its journal, so what the store gets back per key is exactly what this process held and had not
    admitted.
    """

    __slots__ = ("id", "buckets", "counters", "refunded", "back")

    def __init__(self, grant_id: str) -> None:
        self.id = grant_id
        #: the ops that took the units (cost: units taken), keyed by store key
        self.buckets: dict[str, BucketOp] = {}
        self.counters: dict[str, CounterOp] = {}
        #: key -> units requests refunded into this grant's slices (beside what it took)
        self.refunded: dict[str, float] = {}
        #: key -> units its settle gives back (set when the book lets the grant go)
        self.back: dict[str, float] = {}

    def holds_at_most(self, key: str) -> float:
        """The units of `key` this grant brought: what it took from the store (none for a refund's
        own grant) and what requests refunded into it."""
        op = self.buckets.get(key) or self.counters.get(key)
        took = max(0.0, float(op.cost)) if op is not None else 0.0
        return took + self.refunded.get(key, 0.0)

    def give_back(self) -> tuple[list[BucketOp], list[CounterOp]]:
        """The settle ops that return the units put on this grant when it was let go."""
        back = self.back
        buckets = [BucketOp(k, b.capacity, b.rate_per_s, -back[k]) for k, b in self.buckets.items() if back.get(k, 0) > 0]
        counters = [CounterOp(k, None, -int(back[k]), c.expires_at) for k, c in self.counters.items() if back.get(k, 0) > 0]  # fmt: skip
        return buckets, counters


class KeyState:
    """One store key (a bucket or a period counter) as this process sees it."""

    __slots__ = ("grants", "left", "aside", "used", "rate", "last_size", "contended_until", "level", "ts", "store_left", "limit", "seen")  # fmt: skip

    def __init__(self, limit: float) -> None:
        #: the open grants that took units of this key (one of them gives `left` back when let go)
        self.grants: list[Grant] = []
        #: units held and not yet admitted
        self.left = 0.0
        #: units held that a top-up in flight set aside for its request (out of `left` meanwhile,
        #: still held: headers and levels count them)
        self.aside = 0.0
        #: units admitted since the last tick, and the smoothed units per second they make
        self.used = 0.0
        self.rate = 0.0
        self.last_size = 0.0
        #: until then, slices hold only what a request needs (a top-up at a slice's size was refused)
        self.contended_until = 0.0
        #: a bucket's level in the store after this process's last acquire, at `ts` (headers)
        self.level = 0.0
        self.ts = 0.0
        #: units the store had left after that acquire (slices shrink as it runs low); None: not seen
        self.store_left: float | None = None
        #: the capacity (bucket) or limit (counter) the slices were taken under
        self.limit = limit
        self.seen = 0.0


class SliceBook:
    """Every key's slices in this process; admits from them without a store call."""

    def __init__(self, slice_s: float, max_share: float) -> None:
        self._slice_s = slice_s
        self._max_share = max_share
        self.keys: dict[str, KeyState] = {}
        #: every grant not yet given back, spent ones included: each is closed by a settle of its id,
        #: which drops its journal (else the crash recovery would give back units already admitted)
        self.open: dict[str, Grant] = {}

    def state(self, key: str, limit: float) -> KeyState:
        ks = self.keys.get(key)
        if ks is None:
            ks = self.keys[key] = KeyState(limit)
        return ks

    def fits(self, needs: list[tuple[str, float, float]]) -> bool:
        """Whether the slices hold every (key, units, limit) at once (a key may repeat)."""
        want: dict[str, float] = {}
        for key, units, limit in needs:
            ks = self.keys.get(key)
            if ks is None or ks.limit != limit:
                return False
            want[key] = want.get(key, 0.0) + units
            if ks.left + token_bucket.BUCKET_EPSILON < want[key]:
                return False
        return True

    def consume(self, key: str, units: float, now: float) -> None:
        """Admit `units` of `key` from its slices; `fits` said they are there."""
        ks = self.keys[key]
        ks.left -= units
        ks.used += units
        ks.seen = now

    def set_aside(self, needs: list[tuple[str, float, float]]) -> list[float]:
        """Take off the units held what each (key, units, limit) can have of them, in order; returns
        the units taken for each, for `put_back`. A top-up sets aside what its request will take, so
        that no request admitted from memory while the store is asked spends units it counted on."""
        aside = []
        for key, units, limit in needs:
            ks = self.keys.get(key)
            take = min(ks.left, units) if ks is not None and ks.limit == limit and ks.left > 0 else 0.0
            if take:
                ks.left -= take
                ks.aside += take
            aside.append(take)
        return aside

    def put_back(self, needs: list[tuple[str, float, float]], aside: list[float]) -> None:
        """Return what `set_aside` took (the request then takes its units with `consume`, or is refused)."""
        for (key, _, _), units in zip(needs, aside, strict=True):
            ks = self.keys.get(key)
            if units and ks is not None:
                ks.left += units
                ks.aside -= units

    def refund(self, key: str, units: float, op: BucketOp | CounterOp) -> bool:
        """Units a request reserved and did not use (`op`: its settle op), back into the slices of
        `key` held, with a grant of their own when none is open (never journaled: the store already
        counts them, as it counts a slice, and its tick gives them back the same way). False when
        this process no longer follows `key` (the refund then goes with the next batch).

        So a refund is admitted from here at once, as a per-request settle would free it in the store."""
        ks = self.keys.get(key)
        if ks is None:
            return False
        if not ks.grants:
            grant = Grant(f"refund.{token_hex(12)}")
            if isinstance(op, BucketOp):
                grant.buckets[key] = op
            else:
                grant.counters[key] = op
            self.open[grant.id] = grant
            ks.grants.append(grant)
        newest = ks.grants[-1]
        newest.refunded[key] = newest.refunded.get(key, 0.0) + units
        ks.left += units
        return True

    def size(self, key: str, need: float, limit: float, now: float, held: float) -> float:
        """Units to hold after a top-up of `key` for a request needing `need`: about `slice_s` of the
        observed rate, doubling while slices run out, never above `max_share` of the limit nor of what
        the store had left at the last look, never below `need` (then it is the per-request path).
        `held`: the units counted as held beside that share (a top-up: what this process holds, set
        aside included; a tick's fresh slices: 0, the old ones going back)."""
        ks = self.keys.get(key)
        if ks is None or ks.contended_until > now:
            return need
        want = max(math.ceil(ks.rate * self._slice_s), 2 * ks.last_size, 1.0)
        share = limit * self._max_share
        want = min(want, share)
        if ks.store_left is not None:  # under contention the store runs low: slices shrink towards 1
            want = min(want, held + max(0.0, ks.store_left) * self._max_share)
        return max(need, math.floor(want))

    def add(self, grant: Grant, key: str, units: float, limit: float, now: float) -> None:
        """Record `units` of `key` taken by `grant`."""
        ks = self.state(key, limit)
        self.open[grant.id] = grant
        ks.grants.append(grant)
        ks.left += units
        ks.last_size = ks.left
        ks.seen = now

    def bucket_view(self, key: str, op: BucketOp, now: float) -> BucketView:
        """A bucket as the client would see it after this request: the store's level drained to now,
        less the units this process holds and has not admitted (x-ratelimit-* headers)."""
        ks = self.keys[key]
        level = max(0.0, token_bucket.drain(ks.level, ks.ts, op.rate_per_s, now) - ks.left - ks.aside)
        return BucketView(token_bucket.remaining(level, op.capacity), token_bucket.reset_s(level, op.rate_per_s))

    def take_all(self) -> list[Grant]:
        """Every open grant, forgotten here with each key's units left put on their settles (to be
        given back): at a tick, a reload, a shutdown."""
        for key, ks in self.keys.items():
            _spread_back(key, ks)
            ks.grants = []
            ks.left = 0.0
        grants, self.open = list(self.open.values()), {}
        return grants

    def forget(self, key: str) -> None:
        """Stop admitting from `key`'s slices (its limit changed): its units left go on its grants'
        settles, given back with the next `take_all`; the other keys' slices stay as they are."""
        ks = self.keys.pop(key, None)
        if ks is not None:
            _spread_back(key, ks)

    def tick(self, elapsed: float, now: float) -> list[str]:
        """Update each key's observed rate; forget idle keys. Returns the keys used since the last tick."""
        active = []
        for key, ks in list(self.keys.items()):
            if ks.used:
                active.append(key)
            ks.rate = 0.5 * ks.rate + 0.5 * ks.used / max(elapsed, 1e-3)
            ks.used = 0.0
            if not ks.grants and now - ks.seen > _IDLE_FORGET_S:
                del self.keys[key]
        return active


def _spread_back(key: str, ks: KeyState) -> None:
    """Put the units of `key` held and not admitted on its grants' settles: newest grant first, each
    at most what it brought, so each settle gives back its own grant's share as if requests had been
    admitted from the oldest grant first (should a tick's settles be applied only in part and the
    process then die, the crash recovery of the others' journals gives back no unit twice). The
    grants brought at least what is left: `left` is what they took and refunds added, less what
    requests consumed."""
    left = ks.left
    for g in reversed(ks.grants):
        if left <= 0:
            break
        share = min(left, g.holds_at_most(key))
        g.back[key] = g.back.get(key, 0.0) + share
        left -= share
