"""Leased concurrency slots for engine builds, one limit per device (``engine-build:<device>``).

Prefect's tag limits keep a slot until its task run reports an end, so a compile killed with SIGKILL
leaked its slots into the server's database and every later build waited forever. These are Prefect's
global concurrency limits instead: a slot is a lease that the holder renews while it lives and that
expires ``LEASE_SECONDS`` after it dies. A build that cannot get a slot within ``slot_timeout`` seconds
fails with a message naming the limit and how to inspect or reset it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from compiler.errors import KilnError

# How long a dead holder's slot stays taken; short leases cost renewals, long ones a wait after a kill.
LEASE_SECONDS = 60.0  # the shortest lease Prefect's server accepts
DEFAULT_SLOT_TIMEOUT = 3600.0


class BuildSlotTimeoutError(KilnError):
    """No engine-build slot for a device came free in time."""


def limit_name(device: str) -> str:
    return f"engine-build:{device}"


def ensure_limits(limits: dict[str, int]) -> dict[str, int]:
    """Create or update the global concurrency limit of each device's engine builds; returns name -> limit."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    named = {limit_name(device): n for device, n in sorted(limits.items())}
    with get_client(sync_client=True) as client:
        for name, n in named.items():
            try:
                client.read_global_concurrency_limit_by_name(name)
                exists = True
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=n))
                    exists = False
                except ObjectAlreadyExists:  # another worker of the fleet created it meanwhile
                    exists = True
            if exists:
                client.update_global_concurrency_limit(
                    name, GlobalConcurrencyLimitUpdate(limit=n, active=True)
                )
    return named


@contextlib.contextmanager
def build_slot(device: str, timeout: float | None = None) -> Iterator[None]:
    """Hold one leased slot of the device's build limit (no limit defined: no wait)."""
    from prefect.concurrency.sync import concurrency

    name = limit_name(device)
    wait = DEFAULT_SLOT_TIMEOUT if timeout is None else timeout
    try:
        with concurrency(name, occupy=1, timeout_seconds=wait, lease_duration=LEASE_SECONDS, strict=False):
            yield
    except TimeoutError as exc:
        raise BuildSlotTimeoutError(
            f"no slot of concurrency limit {name!r} came free within {wait:.0f} s; every slot is held "
            f"by running builds (a killed run frees its slot {LEASE_SECONDS:.0f} s after it died). "
            f"Inspect it with 'prefect gcl inspect {name}'; reset it with 'prefect gcl delete {name}' "
            "(the next run creates it again)"
        ) from exc
