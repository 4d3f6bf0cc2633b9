"""The default process group: started from torchrun's environment when none is (gloo without CUDA, NCCL with it), a
restarted attempt's own store keys, and gloo's exit grace."""

from __future__ import annotations

import atexit
import os
import time

import torch
import torch.distributed as dist

__all__ = ["ensure_process_group", "register_gloo_exit_grace"]


def ensure_process_group() -> None:
    """Use the initialised default process group, or start one from the torchrun environment."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "MeshContext.build needs torch.distributed: launch with `torchrun --nproc-per-node N script.py` or call "
            "torch.distributed.init_process_group() first."
        )
    restart = _restart_store()
    if not torch.cuda.is_available():
        dist.init_process_group(backend="gloo", **restart)
        return
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    # A bound device lets `init_device_mesh` create each mesh dim's groups with one `split_group` (ncclCommSplit)
    # instead of one `new_group` call per subgroup of the whole world: O(1) instead of O(N) calls per rank.
    dist.init_process_group(backend="nccl", device_id=device, **restart)


def _restart_store() -> dict[str, object]:
    """After a torchrun restart (``--max-restarts``), the store keys of this attempt's own: without them, a restarted
    gloo group reads the connection addresses of the attempt that died, and its init fails ("connectFullMesh failed
    ... Connection refused", torch 2.13). Nothing (the default ``env://`` init) on a first attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0:
        return {}
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store = dist.PrefixStore(f"automodel/restart_{attempt}", client)
    return {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


# How long a process that used gloo releases the GIL at exit (see `_let_gloo_workers_finish`).
_GLOO_EXIT_GRACE_S = 0.05


def _let_gloo_workers_finish() -> None:
    """At interpreter exit, before shutdown starts: release the GIL for a moment so gloo's worker threads can drop
    the collectives they have just finished.

    A worker thread releases its reference to a collective's tensors a moment after the collective returns; where
    Python dropped a tensor first, that release takes the GIL. If the interpreter is already shutting down by then
    (a script whose last collective was just before its end), the thread is stopped inside torch and the process
    aborts: "terminate called without an active exception" from ``ProcessGroupGloo::runLoop``, a finished run ending
    with SIGABRT (about 1 run in 15 of a two-rank FSDP2 script on a loaded CPU machine). ``destroy_process_group``
    does not help while a model still holds its meshes' groups, and gloo's ``shutdown`` does not join the threads."""
    time.sleep(_GLOO_EXIT_GRACE_S)


_gloo_exit_grace_registered = False


def register_gloo_exit_grace() -> None:
    """Once in a process that builds a mesh over gloo: :func:`_let_gloo_workers_finish` at exit."""
    global _gloo_exit_grace_registered
    if not _gloo_exit_grace_registered and "gloo" in str(dist.get_backend()):
        _gloo_exit_grace_registered = True
        atexit.register(_let_gloo_workers_finish)
