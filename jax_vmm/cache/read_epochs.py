"""Read epochs: which table of ensured tokens a step's attention reads on the CPU.

XLA:CPU runs a step on its own threads after its dispatch returned, and the CPU handlers
read the KV arena's table of ensured tokens when they run. A release that lowered the
table at once would clamp the reads of a step dispatched before it; one that waited for
that step would block the dispatching thread. So a KV arena on the CPU that releases
while work is in flight advances its *read epoch* instead: the core keeps the table as it
stood for the readers of the old epoch (``KvCache::BeginEpoch``, ``kv_cache.h``) and the
new, lowered table is the live one.

An arena layer's ordering token carries, as its value, the epoch of the dispatch it
belongs to, and the attention handlers read the table of that epoch. Writes always check
the live table. This module keeps the tokens current:

* a new token (``kv.cache()``) holds the arena's current epoch;
* a step's returned tokens hold the epoch the step was dispatched in (the kernels pass
  the value on), which is the current one when the step returns;
* when a layer whose token is of an older epoch is flattened for a dispatch (it crosses
  a ``jit`` boundary) or its token is read, the token is replaced by one of the current
  epoch computed from it (:func:`renew`), so the order after the writes that produced it
  stays and the new step reads the table a release lowered.

Thread-safety: the per-arena epochs are plain dict entries written by the arena under
its lock; a flatten racing a release reads the epoch before or after it, which is the
same as dispatching before or after the release.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .ids import LayerId

_epochs: dict[int, int] = {}  # arena uid -> current read epoch (absent: 0)

#: Test hook (``jax_vmm.testing.read_epochs_kept()``): when False a layer keeps its
#: token's old epoch across a release (no renewal).
renewing = True


def current(uid: int) -> int:
    """Arena ``uid``'s read epoch: what a token made now carries."""
    return _epochs.get(uid, 0)


def advance(uid: int, epoch: int) -> None:
    """Arena ``uid`` is at ``epoch`` now (its core cache advanced it)."""
    _epochs[uid] = epoch


def forget(uid: int) -> None:
    """Arena ``uid`` was closed."""
    _epochs.pop(uid, None)


@jax.jit
def _renewed_token(token: jax.Array, epoch: jax.Array) -> jax.Array:
    # Depends on the old token: it runs after the writes that produced it. XLA:CPU runs a
    # computation under ~1000 flops inline on the dispatching thread, which would wait
    # there for the old token (the step in flight); this one costs 4096 flops, so its
    # dispatch returns at once. The comparison is never true, and XLA cannot know that.
    spin = jnp.sum(jnp.broadcast_to(token.astype(jnp.float32), (4096,)))
    return epoch + (spin > 1e30).astype(jnp.int32)


def renew(lid: LayerId, token: Any) -> tuple[Any, int]:
    """(token of the current epoch ordered after ``token``, that epoch)."""
    epoch = current(lid.cache_uid)
    return _renewed_token(token, np.int32(epoch)), epoch


_warm: set[jax.Device] = set()


def warm_up(device: jax.Device) -> None:
    """Compile :func:`renew`'s computation for ``device`` now (a KV arena on the CPU is
    made), so the first dispatch after a release does not compile it."""
    if device not in _warm:
        _renewed_token(jax.device_put(np.int32(0), device), np.int32(0)).block_until_ready()
        _warm.add(device)
