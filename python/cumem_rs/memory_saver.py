"""torch_memory_saver's API over cumem_rs: `from cumem_rs.memory_saver import torch_memory_saver`.

A drop-in for `from torch_memory_saver import torch_memory_saver` (version 0.0.10): every call and argument of
that API is accepted, and the calls do what they do there, over `CuMemAllocator`'s machinery:

* `hook_mode`: "preload" (torch_memory_saver's default) routes the `cudaMalloc` calls of torch's own caching
  allocator through the preload hook library (`LD_PRELOAD`, see `configure_subprocess()`), on every thread; "torch"
  routes through torch's pluggable allocator and a MemPool per region (no `LD_PRELOAD` needed). Left unset, a
  saver uses "preload" when the hook library is loaded in the process and "torch" otherwise;
* `region(tag, enable_cpu_backup)`: the calling thread's allocations inside go to cumem_rs under `tag` (preload:
  the hook, with a private torch MemPool per tag and backup as there; torch: `CuMemAllocator.use_memory_pool`),
  with the tag's policy set to `backup=enable_cpu_backup` (`set_tag_policy`), so that `pause` backs up exactly the
  regions that asked for it;
* `pause(tag)` / `resume(tag)`: `CuMemAllocator.pause` / `resume` of that tag, or of every tag a region or graph
  of this object used when `tag` is None;
* `cuda_graph(...)`: `torch.cuda.graph(...)` with the capture's memory under `tag` (preload: its cudaMalloc calls
  routed; torch: a pool of ours), so graph memory pauses too and replays are valid after resume (addresses never
  change);
* `disable()`: allocations inside go to torch's own allocator (and, in preload mode, to the CUDA runtime), as
  there;
* `TMS_INIT_ENABLE=1` (preload mode): every allocation of every thread from the import of this module on, outside
  regions and `disable()`, is cumem_rs's under the tag "default", backed up per `TMS_INIT_ENABLE_CPU_BACKUP`;
* `enable_disk_backup` / `set_disk_backup_dir`: the tag's backups go to the file tier (`backup_tier="file"`,
  `set_spill_dir`), with one visible file per paused allocation in a directory named by set_disk_backup_dir or
  TMS_DISK_BACKUP_DIR, as there (`set_spill_dir(named=True)`);
* `retain_cpu_backup` (False by default, as there): the allocator's `set_keep_host_memory`; without it a resume
  returns the backup's host memory to the OS;
* `get_cpu_backup(x, zero_copy=True)`: a tensor over the raw host backup itself, which it keeps alive
  (`_tms_backup.py`);
* the `TMS_*` environment variables, read when the saver initialises (`_tms_env.py`).

Where torch_memory_saver exits the process (a CUDA error, pausing a paused tag, an unknown tensor, a bad
environment value), this raises a Python exception instead. docs/torch_memory_saver.md lists every
difference.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch

from . import _native, _preload
from ._native import CumemError, CumemOutOfMemoryError, CumemTypeError, CumemValueError, HostBytes
from ._pools import (
    check_tag,
    new_pool,
    pool_activity,
    pool_block,
    pool_holds_asleep_memory_or,
    refuse_capture_into_asleep_pool,
)
from ._tms_backup import copy_of, tensor_of_bytes, tensor_over
from ._tms_env import CPU_BACKUP_BACKENDS, TmsEnv, read_tms_env
from ._tms_state import DEFAULT_TAG, CState, Impl, RegionState, ThreadStates

if TYPE_CHECKING:
    from ._sim_pools import SimulatedPools
    from .allocator import CuMemAllocator

    Backend = Union[CuMemAllocator, SimulatedPools]

HookMode = Literal["preload", "torch"]
CpuBackupBackend = Literal["mmap", "pinned"]

_TAG_DEFAULT = "default"
_HOOK_MODES = ("preload", "torch")
#: A tag's backup, one per tag: none (undefined after resume), host memory, or files in the spill directory.
_NONE, _CPU, _DISK = "none", "cpu", "disk"


def _check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise CumemTypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_backup_args(enable_cpu_backup: object, enable_disk_backup: object, cpu_backup_backend: object) -> str:
    """Validate the backup arguments of region/cuda_graph up front; returns the backup (_NONE, _CPU or _DISK)."""
    cpu = _check_flag(enable_cpu_backup, "enable_cpu_backup")
    disk = _check_flag(enable_disk_backup, "enable_disk_backup")
    if cpu_backup_backend is not None:
        if cpu_backup_backend not in CPU_BACKUP_BACKENDS:
            raise CumemValueError(
                f"cpu_backup_backend must be one of {CPU_BACKUP_BACKENDS} or None, got {cpu_backup_backend!r}"
            )
        if not cpu:
            raise CumemValueError("cpu_backup_backend requires enable_cpu_backup=True")
    if cpu and disk:
        raise CumemValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
    return _CPU if cpu else _DISK if disk else _NONE


def _pool_key(pool: object) -> tuple[int, int]:
    """A graph pool token (from torch.cuda.graph_pool_handle() or CUDAGraph.pool()) as a hashable tuple."""
    if isinstance(pool, (tuple, list)) and len(pool) == 2 and all(isinstance(v, int) for v in pool):
        return (int(pool[0]), int(pool[1]))
    raise CumemTypeError(
        f"pool must be a graph pool token (torch.cuda.graph_pool_handle() or CUDAGraph.pool()), got {pool!r}"
    )


def configure_subprocess() -> contextlib.AbstractContextManager[None]:
    """Child processes started inside the block load the preload hook library (it is put first in LD_PRELOAD, as
    torch_memory_saver does; the previous value is restored at exit), so that hook_mode="preload" and
    TMS_INIT_ENABLE=1 work there."""
    return _preload.configure_subprocess()


class TorchMemorySaver:
    """The API of torch_memory_saver 0.0.10 over `CuMemAllocator`. Use the module's `torch_memory_saver`."""

    def __init__(self, _backend: Optional["Backend"] = None) -> None:
        self._lock = threading.Lock()
        # Per thread: the active regions and disable() (what torch_memory_saver's C-level getters report).
        self._threads = ThreadStates()
        self._impl_state: Optional[Impl] = None
        self._init_lock = threading.Lock()
        # `_backend`: what to run over instead of the process-wide CuMemAllocator (a SimulatedPools in CPU-only
        # tests); `_alloc` is set once the saver has initialised (`_ensure_initialized`).
        self._backend = _backend
        self._alloc: Optional[Backend] = None
        self._env = TmsEnv()
        # The hook_mode set by the user (None: not set, see `hook_mode`) and, once initialised, whether this saver
        # routes through the preload hook.
        self._hook_mode: Optional[HookMode] = None
        self._preload = False
        # Preload mode: torch's own MemPool per (tag, backup, device) of a region, as torch_memory_saver keeps them,
        # so that region memory and other memory never share torch's cached blocks.
        self._region_pools: dict[tuple[str, str, int], torch.cuda.MemPool] = {}
        self._memory_margin_bytes = 0
        # retain_cpu_backup was set to False while the allocator kept host memory: applied by the next resume.
        self._release_at_resume = False
        # Every tag a region or graph of this object used, with its backup (one setting per tag).
        # Per tag of the API: backup setting -> the allocator tag holding that memory (`_use_tag`).
        self._tags: dict[str, dict[str, str]] = {}
        # The other way round: each allocator tag handed out -> the API tag whose memory it holds.
        self._inner_owner: dict[str, str] = {}
        # Whether the spill directory of disk-backup regions is set: by set_disk_backup_dir or TMS_DISK_BACKUP_DIR;
        # else the first disk-backup region sets the system temp directory (torch_memory_saver's /tmp).
        self._disk_dir_applied = False
        # Our pools standing in for graph pool tokens of torch's own pools, per (token, device), and the tokens of
        # our pools (what CUDAGraph.pool() returns after a capture here), which are used as they are.
        self._graph_pools: dict[tuple[tuple[int, int], int], Any] = {}
        self._our_pool_ids: set[tuple[int, int]] = set()

    # -- set-up ---------------------------------------------------------------------------------------------------

    def _ensure_initialized(self) -> None:
        """Read the `TMS_*` environment and set up the allocator, once (later calls return at once), as
        torch_memory_saver does on its first use, and choose the hook mode (see `hook_mode`). Raises
        CumemValueError naming a variable with a bad value (TMS_*, or a PYTORCH_CUDA_ALLOC_CONF that bypasses
        cudaMalloc in preload mode), CumemError when preload mode (or TMS_INIT_ENABLE=1) is asked for and the hook
        library is not loaded in this process, or without a usable GPU; after a failure the next call tries
        again."""
        if self._alloc is not None:
            return
        with self._init_lock:
            if self._alloc is not None:
                return
            env = read_tms_env(os.environ)
            preload = self._choose_preload(env)
            if self._backend is not None:
                alloc = self._backend
            else:
                from .allocator import CuMemAllocator

                alloc = CuMemAllocator.get_instance()
            # What can fail goes first, so that a refused set-up leaves the allocator as it was.
            if env.disk_backup_dir is not None:
                _apply_disk_dir(alloc, env.disk_backup_dir, "TMS_DISK_BACKUP_DIR", named=True)
                self._disk_dir_applied = True
            if env.disk_backup_chunk_mb is not None:
                try:
                    alloc.set_staging_bytes(env.disk_backup_chunk_mb << 20)
                except (ValueError, OverflowError) as e:
                    raise CumemValueError(f"TMS_DISK_BACKUP_CHUNK_MB={env.disk_backup_chunk_mb}: {e}") from e
            # torch_memory_saver's default: the backup's host memory goes back to the OS at resume.
            alloc.native.set_keep_host_memory(env.retain_cpu_backup)
            if preload:
                _native.preload_route_to(alloc.native)
                if env.init_enable:
                    self._use_tag(alloc, _TAG_DEFAULT, _init_backup(env))
                _native.preload_set_init_enable(env.init_enable)
            self._preload = preload
            self._env = env
            self._alloc = alloc

    def _choose_preload(self, env: TmsEnv) -> bool:
        """Whether this saver routes through the preload hook: hook_mode "preload" set explicitly (the library must
        be loaded), or left unset while the library is loaded in this process."""
        loaded = _preload.activate()
        preload = self._hook_mode == "preload" or (self._hook_mode is None and loaded)
        if preload and not loaded:
            raise CumemError(
                "hook_mode='preload' needs the preload hook library loaded in this process, which it is not: start "
                "the process inside cumem_rs.memory_saver.configure_subprocess() (or with LD_PRELOAD="
                f"{_preload.library_path()}), or use hook_mode='torch'"
            )
        if env.init_enable and not preload:
            if self._hook_mode == "torch":
                raise CumemValueError(
                    "TMS_INIT_ENABLE=1 routes allocations outside regions, which only hook_mode='preload' does; "
                    "unset TMS_INIT_ENABLE or use hook_mode='preload'"
                )
            raise CumemError(
                "TMS_INIT_ENABLE=1 routes every CUDA allocation outside regions into the saver, through the preload "
                "hook library, which is not loaded in this process: start the process inside "
                "cumem_rs.memory_saver.configure_subprocess() (or with LD_PRELOAD="
                f"{_preload.library_path()}), or unset TMS_INIT_ENABLE and wrap the allocations to pause in region()"
            )
        if preload:
            _preload.check_alloc_conf(os.environ)
        return preload

    def _allocator(self) -> "Backend":
        """The allocator, after `_ensure_initialized` (raises CumemError without a usable GPU)."""
        self._ensure_initialized()
        assert self._alloc is not None
        return self._alloc

    def _use_tag(self, alloc: "Backend", tag: str, backup: str) -> str:
        """The allocator tag that holds `tag`'s memory with this backup setting, its policy set the first time.

        torch_memory_saver records the backup setting per allocation, so one tag may hold memory with and without
        backup; the allocator keeps one policy per tag. So the first setting seen for `tag` uses `tag` itself
        and each other setting a tag of its own (`tag[no_backup]`, `tag[cpu_backup]`, `tag[disk_backup]`);
        pause and resume of `tag` act on all of them. Tags are arbitrary strings, so a user's tag may spell a
        name handed out before (or the tag of memory the allocator holds from outside the saver): every name is
        chosen free of those (`_free_inner_name`), so no tag ever reaches another's memory or policy."""
        with self._lock:
            settings = self._tags.get(tag, {})
            inner = settings.get(backup)
            if inner is not None:
                return inner
            inner = self._free_inner_name(alloc, tag if not settings else f"{tag}[{_SHORT[backup]}]", tag)
            if backup == _DISK and not self._disk_dir_applied:
                # Nobody named this directory, and others share it: unlinked files, which nothing leaves behind.
                _apply_disk_dir(alloc, tempfile.gettempdir(), "the disk backup directory (system temp)", named=False)
                self._disk_dir_applied = True
            # Keep a wake_fill (and, but for disk backup, a tier) set ahead through set_tag_policy. Uncompressed, as
            # torch_memory_saver's backups are: get_cpu_backup reads a paused tensor's bytes on the host, and only a
            # wake restores a backup that the GPU compressed.
            policy = alloc.native.tag_policy(inner)
            tier = "file" if backup == _DISK else policy.get("backup_tier", "auto")
            alloc.set_tag_policy(
                inner, backup=backup != _NONE, wake_fill=policy["wake_fill"], backup_tier=tier, compress="off"
            )
            # Recorded once the policy is set: a refused one hands out no name.
            self._tags.setdefault(tag, {})[backup] = inner
            self._inner_owner[inner] = tag
            return inner

    def _free_inner_name(self, alloc: "Backend", name: str, tag: str) -> str:
        """`name`, or `name#2`, `name#3`... the first that is no allocator tag handed out here, no other API tag
        (its own name is what a later first use of it takes), and, but for `tag` itself, no tag of memory the
        allocator holds (caller holds the lock)."""
        taken = set(self._inner_owner) | (set(self._tags) - {tag})
        outside = {str(a["tag"]) for a in alloc.native.allocations()} - {tag}
        candidate, n = name, 1
        while candidate in taken or (candidate != tag and candidate in outside):
            n += 1
            candidate = f"{name}#{n}"
        return candidate

    def _tags_of(self, tag: Optional[str]) -> list[str]:
        """The allocator tags a pause/resume acts on: those of `tag`, or of every tag this object used. A tag not
        used here is the allocator's tag of that name, unless that name holds another tag's memory here (then
        nothing)."""
        with self._lock:
            if tag is not None:
                check_tag(tag)
                if tag in self._tags:
                    return sorted(self._tags[tag].values())
                return [] if tag in self._inner_owner else [tag]
            return sorted(self._inner_owner)

    # -- regions --------------------------------------------------------------------------------------------------

    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Allocate the tensors created on this thread inside the block under `tag`, pausable. With
        `enable_cpu_backup` their contents are copied to host memory at pause and restored at resume, with
        `enable_disk_backup` (exclusive with it) to files in the disk backup directory; without either, they come
        back undefined. `cpu_backup_backend` ("pinned" or "mmap") is accepted: backups here are always mmap'd host
        memory pinned for fast copies and unmapped when released."""
        check_tag(tag)
        backup = _check_backup_args(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        return self._region(tag, backup, cpu_backup_backend)

    @contextlib.contextmanager
    def _region(self, tag: str, backup: str, backend: Optional[str] = None) -> Iterator[None]:
        alloc = self._allocator()
        inner = self._use_tag(alloc, tag, backup)
        state = RegionState(tag, backup == _CPU, backend or self._default_backend())
        self._threads.regions.append(state)
        try:
            with self._routed_region(alloc, inner, backup):
                yield
        finally:
            self._threads.regions.pop()

    @contextlib.contextmanager
    def _routed_region(self, alloc: "Backend", inner: str, backup: str) -> Iterator[None]:
        if not self._preload:
            with alloc.use_memory_pool(inner):
                yield
            return
        with contextlib.ExitStack() as stack:
            if self._backend is None:  # torch's tensors (a simulated backend has none)
                stack.enter_context(self._region_pool(alloc.native, (inner, backup, torch.cuda.current_device())))
            stack.enter_context(_preload.routed(inner))
            yield

    @contextlib.contextmanager
    def _region_pool(self, native: _native.Allocator, key: tuple[str, str, int]) -> Iterator[None]:
        """Route this thread's torch allocations to the region's own pool of torch's caching allocator. A pool
        holding paused memory is replaced by a fresh one (`_pools`: torch would hand out its cached blocks,
        unmapped); the old one is dropped once no block routes, its live tensors keeping their memory."""
        with pool_block() as held:  # no pool is dropped while this block routes
            with self._lock:
                pool = self._region_pools.get(key)
                # When it cannot tell: as if it did (a fresh pool is safe; one handing out unmapped memory is not).
                if pool is not None and pool_holds_asleep_memory_or(native, pool.id, True, "a region's pool"):
                    pool_activity.retire([pool])  # replaced below (the key stays: atexit is registered once)
                    pool = None
                if pool is None:
                    if not self._region_pools:
                        atexit.register(self._release_region_pools)
                    pool = self._region_pools[key] = torch.cuda.MemPool()
            # The block's reference goes to `held`, dropped when the block ends: kept in this frame, it would be
            # the last one of a pool another block replaced meanwhile, destroyed after `pool_block` ended, with
            # nothing stopping another thread from routing allocations then (torch aborts).
            held.append(pool)
            del pool
            with torch.cuda.use_mem_pool(held[0]):
                yield

    def _release_region_pools(self) -> None:
        """Drop the region pools before interpreter teardown (once no pool block is active)."""
        with self._lock:
            pools = list(self._region_pools.values())
            self._region_pools.clear()
        atexit.unregister(self._release_region_pools)
        pool_activity.retire(pools)

    def cuda_graph(
        self,
        cuda_graph: torch.cuda.CUDAGraph,
        pool: Optional[Any] = None,
        stream: Optional[torch.cuda.Stream] = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ) -> contextlib.AbstractContextManager[None]:
        """`torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode)` whose memory is pausable under `tag`.

        pool=None gives the graph a pool of its own (as torch does). In preload mode the pool is torch's own, as
        given, and the capture's cudaMalloc calls are routed under `tag`. In torch mode a pool token from an
        earlier capture here (`CUDAGraph.pool()`) is shared as it is; a token of one of torch's own pools
        (`torch.cuda.graph_pool_handle()`) is replaced by one pool of ours per token and device, so graphs that
        shared the token still share memory. Replays are valid after resume: addresses never change."""
        check_tag(tag)
        backup = _check_backup_args(enable_cpu_backup, False, cpu_backup_backend)
        key = None if pool is None else _pool_key(pool)
        return self._cuda_graph(cuda_graph, key, stream, capture_error_mode, tag, backup)

    @contextlib.contextmanager
    def _cuda_graph(
        self,
        cuda_graph: torch.cuda.CUDAGraph,
        key: Optional[tuple[int, int]],
        stream: Optional[torch.cuda.Stream],
        capture_error_mode: str,
        tag: str,
        backup: str,
    ) -> Iterator[None]:
        alloc = self._allocator()
        tag = self._use_tag(alloc, tag, backup)
        mode: Any = capture_error_mode  # torch types it more narrowly than it accepts it (and checks it itself)
        if self._preload:
            # The graph's pool is torch's own (the token as given); its cudaMalloc calls are routed under `tag`.
            if key is not None:
                self._refuse_asleep_graph_pool(alloc, key, tag)
            given: Any = key
            # A pool block, though no pool of ours routes here: torch aborts when a pool is destroyed while a
            # capture is under way, and a region pool replaced meanwhile (`_region_pool`) waits for it to end.
            with pool_block(), torch.cuda.graph(cuda_graph, pool=given, stream=stream, capture_error_mode=mode):
                with _preload.routed(tag):
                    yield
            return
        # `fresh` takes a pool made for this capture alone: retired after it (the graph keeps what it uses).
        with pool_block(alloc.native, tag) as fresh:
            # torch types these more narrowly than it accepts them (and checks them itself).
            token: Any = self._graph_pool_id(key, fresh)
            if key is not None:
                self._refuse_asleep_graph_pool(alloc, token, tag)
            with torch.cuda.graph(cuda_graph, pool=token, stream=stream, capture_error_mode=mode):
                yield

    @staticmethod
    def _refuse_asleep_graph_pool(alloc: "Backend", pool_id: tuple[int, int], tag: str) -> None:
        refuse_capture_into_asleep_pool(
            alloc.native, pool_id, f"graph pool {tuple(pool_id)}",
            f"cuda_graph (tag {tag!r}): the graph pool {tuple(pool_id)} holds memory of a paused tag, which a "
            "capture into it would be handed unmapped (its first use would end the CUDA context); resume that "
            "tag before capturing into this pool",
        )

    def _graph_pool_id(self, key: Optional[tuple[int, int]], fresh: list) -> tuple[int, int]:
        with self._lock:
            if key is None:
                fresh.append(new_pool())
                pool_id = _pool_key(fresh[0].id)
            elif key in self._our_pool_ids:
                return key
            else:
                slot = (key, torch.cuda.current_device())
                if slot not in self._graph_pools:
                    if not self._graph_pools:
                        # Pools must be gone before interpreter teardown (torch aborts on a late pool release).
                        atexit.register(self._release_graph_pools)
                    self._graph_pools[slot] = new_pool()
                pool_id = _pool_key(self._graph_pools[slot].id)
            self._our_pool_ids.add(pool_id)
            return pool_id

    def _release_graph_pools(self) -> None:
        """Drop the pools standing in for torch pool tokens (once no pool block is active); graphs that still use
        their memory keep it."""
        with self._lock:
            pools = list(self._graph_pools.values())
            self._graph_pools.clear()
        atexit.unregister(self._release_graph_pools)
        pool_activity.retire(pools)

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Inside the block, allocations on this thread go to torch's own caching allocator (a private pool of
        it, dropped at exit) and, in preload mode, to the CUDA runtime, not to the enclosing region or to
        TMS_INIT_ENABLE's routing; tensors made here are never paused."""
        if self._alloc is None and (self._hook_mode == "preload" or (self._hook_mode is None and _preload.active())):
            self._ensure_initialized()
        with contextlib.ExitStack() as stack:
            self._threads.disabled += 1
            stack.callback(self._enable_again)
            if self._preload:
                stack.enter_context(_preload.forwarded())
            if self._backend is None:  # torch's tensors (a simulated backend has none)
                retire = stack.enter_context(pool_block())  # no tag: these allocations are torch's, not ours
                retire.append(torch.cuda.MemPool())
                stack.enter_context(torch.cuda.use_mem_pool(retire[0]))
            yield

    def _enable_again(self) -> None:
        self._threads.disabled -= 1

    # -- torch_memory_saver's C-level state -----------------------------------------------------------------------

    @property
    def _impl(self) -> Impl:
        """What torch_memory_saver's own tests read as `_impl._binary_wrapper.cdll.tms_get_*()` (`_tms_state.py`)."""
        if self._impl_state is None:
            self._impl_state = Impl(CState(self._routed_state, self._outside_state))
        return self._impl_state

    def _default_backend(self) -> str:
        """A region's CPU backup backend when it names none: TMS_INIT_CPU_BACKUP_BACKEND, as there."""
        return self._env.init_cpu_backup_backend

    def _routed_state(self) -> Optional[RegionState]:
        """What this thread's allocations are routed as now; None when they are not routed."""
        if self._threads.disabled:
            return None
        if self._threads.regions:
            return self._threads.regions[-1]
        env = self._env
        if env.init_enable and self._preload:
            return RegionState(DEFAULT_TAG, env.init_enable_cpu_backup, env.init_cpu_backup_backend)
        return None

    def _outside_state(self) -> RegionState:
        return RegionState(DEFAULT_TAG, False, self._default_backend())

    # -- pause / resume -------------------------------------------------------------------------------------------

    def pause(self, tag: Optional[str] = None) -> None:
        """Release the GPU memory of `tag` (None: every tag a region or graph here used), copying regions with
        CPU backup to host memory first. Other tags keep running. Pausing a paused tag does nothing."""
        # Set-up first: with TMS_INIT_ENABLE it is what makes the default tag (memory routed since import) known.
        alloc = self._allocator()
        tags = self._tags_of(tag)
        if tags:
            alloc.pause(tags)

    def resume(self, tag: Optional[str] = None) -> None:
        """Map GPU memory at the same addresses again for `tag` (None: every tag used here) and restore CPU
        backups; all or nothing. Refuses with CumemOutOfMemoryError, mapping nothing, when the free device memory
        left afterwards would be below `memory_margin_bytes`."""
        alloc = self._allocator()
        tags = self._tags_of(tag)
        if not tags:
            return
        if self._memory_margin_bytes > 0:
            self._check_margin(alloc, tags)
        if self._release_at_resume:
            alloc.native.set_keep_host_memory(False)
            self._release_at_resume = False
        alloc.resume(tags)

    def _check_margin(self, alloc: "Backend", tags: list[str]) -> None:
        need: dict[int, int] = defaultdict(int)
        wanted = set(tags)
        for a in alloc.native.allocations():
            if a["asleep"] and a["tag"] in wanted:
                need[int(a["device"])] += int(a["size"])
        for device, nbytes in sorted(need.items()):
            free = alloc.native.mem_info(device)[0]
            if free - nbytes < self._memory_margin_bytes:
                raise CumemOutOfMemoryError(
                    f"resume of {tags} needs {nbytes} bytes on device {device}, which would leave "
                    f"{max(free - nbytes, 0)} of {free} free bytes, below memory_margin_bytes="
                    f"{self._memory_margin_bytes}; nothing was resumed"
                )

    # -- settings -------------------------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Always True (as in torch_memory_saver)."""
        return True

    @property
    def hook_mode(self) -> HookMode:
        """How allocations reach cumem_rs: "preload" (torch_memory_saver's default; the preload hook library must
        be loaded in the process: `configure_subprocess()`) or "torch" (torch's pluggable allocator, no LD_PRELOAD;
        CUDA graphs are pausable in both). Unset, it reads "preload" and the saver uses "preload" when the hook
        library is loaded in the process, else "torch"; after set-up it is the mode in use. Set it before the
        first call that sets the saver up, as there."""
        if self._alloc is not None:
            return "preload" if self._preload else "torch"
        return self._hook_mode or "preload"

    @hook_mode.setter
    def hook_mode(self, value: HookMode) -> None:
        if value not in _HOOK_MODES:
            raise CumemValueError(f"hook_mode must be one of {_HOOK_MODES}, got {value!r}")
        if self._alloc is not None and value != self.hook_mode:
            raise CumemValueError(
                f"hook_mode cannot change once the saver is set up (it uses {self.hook_mode!r}); set it first"
            )
        self._hook_mode = value

    @property
    def memory_margin_bytes(self) -> int:
        """Free device memory that `resume` must leave (0: no check)."""
        return self._memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise CumemTypeError(f"memory_margin_bytes must be an int, got {type(value).__name__}")
        if value < 0:
            raise CumemValueError(f"memory_margin_bytes must be non-negative, got {value}")
        self._memory_margin_bytes = value

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep the host backup memory after resume, for a fast next pause (False by default, or
        TMS_RETAIN_CPU_BACKUP, as in torch_memory_saver): cumem_rs's `set_keep_host_memory`, process-wide, set when
        the saver initialises. True also keeps the backups bound to their allocations (retained backups: the next
        pause copies only the chunks that changed); False returns the backup's host memory to the OS at every
        resume, and every pause copies everything. Set to False, it takes effect at the next resume, as there: the
        retained backups of awake memory stay until then (`get_cpu_backup` shows them, a pause reuses them)."""
        native = self._allocator().native
        return not self._release_at_resume and native.keep_host_memory()

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        native = self._allocator().native
        if _check_flag(value, "retain_cpu_backup"):
            self._release_at_resume = False
            native.set_keep_host_memory(True)
        elif native.keep_host_memory():
            # As there, False is consulted by the next resume: until then the retained backups of awake memory stay
            # (get_cpu_backup shows them; a pause reuses them, at the same address).
            self._release_at_resume = True

    def set_disk_backup_dir(self, path: str) -> None:
        """The directory for the backups of disk-backup regions (created if needed), process-wide: the allocator's
        spill directory, in named mode (`set_spill_dir(path, named=True)`). As in torch_memory_saver, each paused
        disk-backed allocation has a file of its own there while it is paused (`cumem_rs-<pid>-<serial>.bak`, mode
        0600, the allocation's bytes rounded up to 4 KiB), removed at resume (kept while awake only with
        retain_cpu_backup, which rewrites just its changed chunks at the next pause), when the memory is freed,
        and at interpreter exit. A process killed while paused leaves its files behind (torch_memory_saver's do
        too); delete them by hand. CumemValueError naming the path when it cannot be used."""
        if not isinstance(path, (str, os.PathLike)):
            raise CumemTypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        _apply_disk_dir(self._allocator(), os.fspath(path), "path", named=True)
        self._disk_dir_applied = True

    # -- backups --------------------------------------------------------------------------------------------------

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> Optional[torch.Tensor]:
        """A CPU tensor (same dtype, shape and strides) with the backed-up contents of the CUDA tensor `x`: of its
        pause while it is paused, or, while it is awake, of the retained backup a resume with retain_cpu_backup
        kept (the bytes of that pause, as there); None when there is none (awake without a retained backup).
        Raises CumemError when `x` was paused without CPU backup and ValueError when it is not memory of a region.

        `zero_copy=True` returns a view: the tensor's storage is the backup's host memory itself, at the same
        address for as long as the backup stays there (across a retained resume and the next pause, which updates
        it in place). It never dangles: after the backup is released (a resume without retain_cpu_backup, a free,
        the allocator closed) or moved, it shows the bytes as they were, and the memory goes back to the OS with
        the last tensor over it. It is writable (torch has no read-only tensors): a write changes what the next
        resume restores, and makes the next pause copy that allocation whole (a write behind the fingerprints'
        back never stays unseen). Where no raw host bytes exist, zero_copy falls back to a copy: a disk backup of a
        paused tensor (read from its file), a compressed one (a policy set outside the saver). `zero_copy=False`
        (the default) always copies."""
        if not isinstance(x, torch.Tensor):
            raise CumemTypeError(f"get_cpu_backup needs a torch.Tensor, got {type(x).__name__}")
        if not x.is_cuda:
            raise CumemValueError(f"get_cpu_backup needs a CUDA tensor, got one on {x.device}")
        if not x.is_contiguous():
            raise CumemValueError(
                f"get_cpu_backup needs a contiguous tensor (shape {tuple(x.shape)}, strides {x.stride()})"
            )
        _check_flag(zero_copy, "zero_copy")
        return self._cpu_backup(x.data_ptr(), x.numel() * x.element_size(), x.dtype, tuple(x.shape), zero_copy)

    def _cpu_backup(
        self, ptr: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], zero_copy: bool
    ) -> Optional[torch.Tensor]:
        """`get_cpu_backup` of the memory [ptr, ptr+nbytes) as a tensor of `dtype` and `shape`."""
        if zero_copy:
            view = self._view_backup(ptr, nbytes, writable=True)
            if view is not None:
                return tensor_over(view, nbytes, dtype, shape)
        data = self._read_backup(ptr, nbytes)
        if data is not None:
            return tensor_of_bytes(data, nbytes, dtype, shape)
        # Awake: the retained backup, if it is in host memory (one in a file is torch_memory_saver's disk backup,
        # which it does not read while awake either).
        return copy_of(self._view_backup(ptr, nbytes, writable=False), nbytes, dtype, shape)

    def _view_backup(self, ptr: int, nbytes: int, writable: bool) -> Optional[HostBytes]:
        """The raw host bytes [ptr, ptr+nbytes) of a backup (of paused memory, or retained by awake memory) where
        they lie; None when there are none (no backup, or one in a file)."""
        try:
            # At least one byte: an empty tensor still answers whether its allocation has a backup.
            return self._allocator().native.view_backup(ptr, max(nbytes, 1), writable)
        except ValueError as e:
            raise CumemValueError(f"tensor at {ptr:#x} ({nbytes} bytes) is not memory of a region: {e}") from e

    def _read_backup(self, ptr: int, nbytes: int) -> Optional[bytes]:
        """A copy of the backed-up bytes [ptr, ptr+nbytes) of paused region memory; None while it is awake."""
        try:
            # At least one byte: an empty tensor still answers whether its allocation is paused.
            return self._allocator().native.read_backup(ptr, max(nbytes, 1))
        except ValueError as e:
            raise CumemValueError(f"tensor at {ptr:#x} ({nbytes} bytes) is not memory of a region: {e}") from e
        except CumemError as e:
            raise CumemError(f"tensor at {ptr:#x} was paused without CPU backup: {e}") from e


def _apply_disk_dir(alloc: "Backend", path: str, name: str, named: bool) -> None:
    """Make `path` the allocator's spill directory (created if needed, as there), with a named file per backup
    when `named`; a ValueError names `name`."""
    try:
        os.makedirs(path, exist_ok=True)
        alloc.native.set_spill_dir(path, named=named)
    except (OSError, ValueError) as e:
        raise CumemValueError(f"{name}={path!r} cannot hold disk backups: {e}") from e
    if named:
        _unlink_named_files_at_exit()


_exit_pid: Optional[int] = None


def _unlink_named_files_at_exit() -> None:
    """Remove the names of the named spill files still there when the interpreter exits (the process-wide
    allocator is never closed, so its paused backups are not dropped), once per process: a forked child inherits
    the handler, not the files."""
    global _exit_pid
    if _exit_pid == os.getpid():
        return
    _exit_pid = os.getpid()

    def unlink() -> None:
        if _exit_pid == os.getpid():
            _native.Allocator.unlink_named_spill_files()

    atexit.register(unlink)


#: The suffix of the allocator tag for memory of a tag with a second backup setting (`_use_tag`).
_SHORT = {_NONE: "no_backup", _CPU: "cpu_backup", _DISK: "disk_backup"}


def _init_backup(env: TmsEnv) -> str:
    """The backup of TMS_INIT_ENABLE's allocations (outside regions)."""
    return _CPU if env.init_enable_cpu_backup else _DISK if env.init_enable_disk_backup else _NONE


def _route_from_import() -> None:
    """Install the hooks if the library is preloaded and, with TMS_INIT_ENABLE=1, route every allocation from now
    on (torch_memory_saver routes from process start; allocations before this import stay the runtime's). A
    failure here routes nothing; the saver's set-up reports it."""
    try:
        if _preload.activate() and read_tms_env(os.environ).init_enable:
            _native.preload_set_init_enable(True)
    except CumemError:  # CumemValueError too: a bad TMS_* value
        pass


_route_from_import()

#: The process-wide saver, as `torch_memory_saver.torch_memory_saver`.
torch_memory_saver = TorchMemorySaver()

__all__ = ["CpuBackupBackend", "HookMode", "TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
