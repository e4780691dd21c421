"""The shared kernel of fleetgate's packages: what `backends`, `policies`, `router` and `gateway`
all build on, and nothing else.

- `fleetgate.spec.SpecBase`: the base of every config Struct (unknown keys are errors).
- `fleetgate.errors.ServingError`: the base of every error a caller may see; `gateway/http/errors.py`
  maps it to each protocol's envelope.

On the package namespace (docs/architecture.md): the project's charter fixes the source layout at
four top-level packages (`gateway`, `backends`, `router`, `policies`), so they install under those
names; fleetgate is installed into its own virtualenv or image (`make install`, the container),
never into a shared interpreter. This package carries the product's name so that its own
foundation cannot clash with anything.
"""

__version__ = "0.1.0"
