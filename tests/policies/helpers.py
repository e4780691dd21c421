"""Small builders shared by the policy tests."""

from __future__ import annotations

from policies.admission import Admission
from policies.errors import RateLimited, StoreUnavailable
from policies.principal import Principal
from policies.stores import StateStore
from policies.types import Limits, Quotas, TenantSpec

ACME = Principal("acme", "0123456789ab", ("*",))
ACME_KEY2 = Principal("acme", "ba9876543210", ("*",))


def admission(
    store: StateStore,
    clock,  # noqa: ANN001 - FakeClock
    *,
    limits: Limits | None = None,
    quotas: Quotas | None = None,
    key_limits: Limits | None = None,
    **kwargs: object,
) -> Admission:
    spec = TenantSpec(limits=limits or Limits(), quotas=quotas or Quotas(), key_limits=key_limits)
    return Admission(store, {"acme": spec}, clock, **kwargs)


class CutStore:
    """A store whose every call fails while `cut` (a link to Redis that went down)."""

    def __init__(self, inner: StateStore) -> None:
        self.inner, self.cut = inner, False

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self.inner, name)

        async def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self.cut:
                raise StoreUnavailable("cut")
            return await attr(*args, **kwargs)

        return call


async def what_another_replica_takes(
    store: StateStore,
    tenants: dict[str, TenantSpec],
    clock,  # noqa: ANN001 - FakeClock
    *,
    tokens: int = 0,
) -> int:
    """Admit ACME's requests of `tokens` each (their units, or 1 a request when 0) through another
    replica asking the store per request, until refused: what the limit still held."""
    other = Admission(store, tenants, clock)
    taken = 0
    while True:
        try:
            await other.reconcile(await other.admit(ACME, "m", tokens), tokens)
        except RateLimited:
            return taken
        taken += tokens or 1


async def admit_until_cut_off(adm: Admission, tokens: int = 0, cost_micros: int = 0, most: int = 200) -> list:
    """ACME's requests admitted one after another until one is refused because the store is cut off
    (StoreUnavailable), at most `most`: what a cut-off gateway still answers."""
    admitted = []
    for _ in range(most):
        try:
            admitted.append(await adm.admit(ACME, "m", tokens, cost_micros=cost_micros))
        except StoreUnavailable:
            break
    return admitted
