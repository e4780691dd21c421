"""Admission: check and reserve every limit and quota of a request, reconcile when it ends.

`admit` builds one all-or-nothing store acquire: per tenant and per key, requests/min (cost 1),
tokens/min (cost = prompt tokens + max_tokens, reserved up front), concurrency (a lease that expires
if this replica dies), and the tenant's day/month quotas. `reconcile` refunds what was reserved but not
used, records usage per tenant+model+period and releases the concurrency slot, once per reservation.

Background requests (batch jobs' lines, `Principal.background`) are admitted against quotas only,
never fail open, and their settlement is handed to their `HeldSettle`; `commit` writes it later
together with the line's done mark, in one atomic store step (gateway/batches/job.py).

The package: `service` (the `Admission` class), `shapes` (the checks of a key's requests, built once
per key, config and day), `leased` (the lease strategy's admission), `reconciling` (settling a
reservation), `reservation` (what an admitted request holds), `settles` (the store settles it
writes), `budgeting` (budgets in money), `refusals` (the errors of a refused request).
"""

from __future__ import annotations

from policies.admission.reservation import Reservation
from policies.admission.service import Admission

__all__ = ["Admission", "Reservation"]
