"""Data parallel, faults and bad input: a rank that dies, inconsistent launches, mismatched ranks,
a too small ``/dev/shm``.

The multi-process tests launch ``python tests/dp_worker.py`` (helpers of tests/test_data_parallel.py); Lightning's
launcher starts rank 1. The others test the pieces in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from megatrain_lightning import testing as T

from megatrain_lightning.parallel.faults import PeerFailure, Peers
from megatrain_lightning.parallel.launcher import ChildWatch, how_it_ended, stop_children
from megatrain_lightning.parallel.lifetime import ENV, dies_with_this_process, parent_env
from megatrain_lightning.parallel.preflight import (RendezvousError, check_rendezvous, differences, mismatch_message,
                                                    optimizer_fingerprint, run_fingerprint)
from megatrain_lightning.store.shared import OwnerTimeout, SharedMemoryTooSmall, SlabOwnership, check_shm
from megatrain_lightning.strategy import MegaTrainStrategy
from test_data_parallel import WORKER, assert_resumed_like, check, free_port
from test_data_parallel import launch as _launch


def launch(*args, **kw):
    """The worker started as ``python train.py`` is: rank 0 only, Lightning's launcher (with this project's watch on
    its children) starting the others; the faults below are those of that path."""
    return _launch(*args, spawn=True, **kw)

TIMEOUT = 20  # the strategy's timeout= in the kill tests (seconds)


def running_with(marker: str) -> list[int]:
    """Pids of live processes (not zombies) whose command line contains ``marker``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state not in ("Z", "X"):
            out.append(int(d.name))
    return out


# ---------------------------------------------------------------------------------------------- a rank dies
@pytest.mark.parametrize("victim", [1, 0])
def test_a_sigkilled_rank_stops_the_other_with_its_name(tmp_path, victim):
    """Rank ``victim`` SIGKILLs itself in the backward of optimizer step 2 (after its first micro-batch's gradients
    went out); the other rank, waiting for its share of a collective, stops with an error naming it within the
    strategy's timeout (gloo sees the closed connection at once), exits non-zero, and no process of the run is left.
    Rank 0 is the one that started rank 1 (Lightning's launcher): killing it leaves rank 1 on its own."""
    t0 = time.monotonic()
    proc = launch(tmp_path, "--steps", "6", "--accumulate", "2", "--kill-rank", str(victim), "--kill-at-step", "2",
                  "--timeout", str(TIMEOUT), timeout=120 + TIMEOUT)
    ended = time.monotonic()
    out = proc.stdout + proc.stderr
    assert (tmp_path / f"killed_{victim}").exists(), out[-4000:]
    assert proc.returncode != 0, out[-4000:]
    if victim == 0:
        assert proc.returncode == -signal.SIGKILL
    survivor = 1 - victim
    named = f"megatrain: rank {victim} stopped responding: its process (pid {(tmp_path / f'killed_{victim}').read_text()}"
    assert named in out, out[-6000:]
    assert f"[rank{survivor}]: megatrain_lightning.parallel.faults.PeerFailure" in out or \
        f"Rank {survivor} stops in" in out, out[-6000:]
    assert "resume from the last checkpoint" in out.lower()
    # from the kill to the end of every process of the run (the pipes close when the last one exits)
    stopped = time.time() - (time.monotonic() - ended)
    assert stopped - (tmp_path / f"killed_{victim}").stat().st_mtime < TIMEOUT + 10, ended - t0
    assert running_with(str(tmp_path)) == []
    assert not (tmp_path / "weights.pt").exists()


def test_a_rank_killed_before_its_forward_stops_the_other_with_a_peer_failure(tmp_path):
    """Rank 1 SIGKILLs itself before the forward of optimizer step 2; rank 0, waiting in shared memory for the
    updates of the slabs rank 1 owns, stops with ``PeerFailure`` naming it (the exception the docs promise for a
    dead rank, whichever wait sees it first)."""
    proc = launch(tmp_path, "--steps", "6", "--kill-rank", "1", "--kill-at-step", "2", "--kill-before-forward",
                  "--timeout", str(TIMEOUT), timeout=120 + TIMEOUT)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "killed_1").exists() and proc.returncode != 0, out[-4000:]
    assert "PeerFailure: megatrain: rank 1" in out and "OwnerTimeout" not in out, out[-6000:]
    assert "resume from the last checkpoint" in out.lower()
    assert running_with(str(tmp_path)) == []


def test_the_run_resumes_exactly_from_the_last_checkpoint_before_the_kill(tmp_path):
    """2 ranks checkpoint every optimizer step (ModelCheckpoint, save_last, the last two kept); rank 1 is SIGKILLed in step 6 (after
    the step-5 checkpoint); rank 0 stops with the named error. ``fit(ckpt_path="last")`` in one process (global batch
    4, as the two ranks' 2 + 2) ends where an uninterrupted 2-rank run ends: every later loss and every final weight
    within 1e-5 relative (a different batch split rounds differently; tests/test_data_parallel.py's resume test)."""
    common = ["--arch", "llama", "--accumulate", "2", "--clip", "0.5", "--sched", "cosine", "--total-steps", "8",
              "--resumable", "--steps", "8"]
    full, killed, rest, ckpts = tmp_path / "full", tmp_path / "killed", tmp_path / "rest", tmp_path / "ckpts"
    check(launch(full, *common, "--devices", "2", "--batch", "2"))
    proc = launch(killed, *common, "--devices", "2", "--batch", "2", "--model-checkpoint", str(ckpts),
                  "--kill-rank", "1", "--kill-at-step", "5", "--timeout", str(TIMEOUT))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "megatrain: rank 1 stopped responding: its process" in out, out[-4000:]
    names = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))
    assert "epoch=0-step=5.ckpt" in names and "epoch=0-step=6.ckpt" not in names and "last.ckpt" in names, names
    check(launch(rest, *common, "--devices", "1", "--batch", "4", "--model-checkpoint", str(ckpts), "--resume", "last"))
    assert_resumed_like(rest, 1, full, 2, skip=5 * 2, n=6)
    assert running_with(str(tmp_path)) == []


def test_a_hanging_rank_stops_the_run_within_twice_the_timeout(tmp_path):
    """Rank 0 hangs (sleeps 10 minutes) in the backward of step 2, strategy timeout 10 s. Rank 1's next collective
    with it gives up after the timeout (at most two: Lightning's per-batch SIGTERM broadcast swallows its own
    timeout, then the gradient all-reduce times out) and rank 1 exits with the error saying so; rank 0's watch on
    its child says which rank ended and kills the hanging rank 0 after its grace period (5 s). The run ends within
    2 x 10 + 5 s plus a margin, and no process is left."""
    proc = launch(tmp_path, "--steps", "6", "--kill-rank", "0", "--kill-at-step", "2", "--hang", "--timeout", "10",
                  timeout=240)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert (tmp_path / "killed_0").exists(), out[-4000:]
    assert "megatrain: a rank stopped responding to rank 1 in " in out, out[-6000:]
    assert "it did not answer within the timeout (10 s, the strategy's timeout=)" in out
    assert "megatrain: rank 1 (local rank 1, pid " in out and "exited with code 1" in out
    assert "megatrain: rank 0 did not stop within 5 s after rank 1 died; killing it." in out
    assert proc.returncode == -signal.SIGKILL
    assert ended - (tmp_path / "killed_0").stat().st_mtime < 2 * 10 + 5 + 15
    assert running_with(str(tmp_path)) == []


def test_stop_children_kills_what_is_left_after_the_grace_period():
    """The launcher's path when local rank 0 raises: children still running after the grace period are killed."""
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=dies_with_this_process())
    stop_children([quick, sleeper], grace_s=0.5)
    assert quick.wait(10) == 0 and sleeper.wait(10) == -signal.SIGKILL


def test_child_watch_names_the_dead_rank_and_stops_the_others(capfd):
    """Lightning's launcher path: a child (local rank 1) dies; the watch says which rank and how, kills the other
    child (local rank 2, asleep) and, after the grace period, the main process (here a stand-in)."""
    dying = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=dies_with_this_process())
    killed = []
    watch = ChildWatch([dying, sleeper], first_rank=4, poll_s=0.05, grace_s=0.2, kill_main=lambda: killed.append(1))
    watch.start()
    watch.join(30)
    assert not watch.is_alive()
    assert sleeper.wait(10) == -signal.SIGKILL
    assert killed == [1]
    err = capfd.readouterr().err
    assert f"megatrain: rank 5 (local rank 1, pid {dying.pid}) was killed by signal 9 (SIGKILL)" in err
    assert "rank 4 did not stop within" in err


def test_child_watch_leaves_main_alone_when_it_stops_by_itself():
    dying = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    killed = []
    watch = ChildWatch([dying], first_rank=0, poll_s=0.05, grace_s=5.0, kill_main=lambda: killed.append(1))
    watch.start()
    while dying.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # the watch saw it and now waits out the grace period
    watch.stopped.set()  # what the launcher does when the main process raises
    watch.join(10)
    assert killed == []
    assert how_it_ended(3) == "exited with code 3"


def gone(pid: int) -> bool:
    """The process ``pid`` has ended (absent, or a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, within_s: float) -> float | None:
    """Seconds until ``pid`` ended, or ``None`` if it still runs after ``within_s`` seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if gone(pid):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_child_started_with_dies_with_this_process_ends_with_its_parent():
    """An intermediate process starts a sleeper with ``preexec_fn=dies_with_this_process()`` (as the tests start
    their workers) and is SIGKILLed: the sleeper is gone within seconds."""
    code = ("import subprocess, sys, time\n"
            "from megatrain_lightning.parallel.lifetime import dies_with_this_process\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
            " preexec_fn=dies_with_this_process())\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              preexec_fn=dies_with_this_process())
    child = int(parent.stdout.readline())
    try:
        assert not gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_gone(child, 5) is not None, "the child outlived its SIGKILLed parent"
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_rank_whose_local_rank_0_was_sigkilled_is_killed_after_the_grace_period(tmp_path):
    """``python train.py`` with 2 devices: rank 1 (started by the strategy's launcher) hangs in step 1; local rank 0,
    waiting for it, is SIGKILLed (as by the OOM killer). Rank 1 does not stay behind: 5 s (the launcher's grace
    period) after rank 0 is gone it is killed, and says so."""
    e = {**os.environ, "MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1"}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", ENV):
        e.pop(k, None)
    log = tmp_path / "stderr.txt"  # both ranks write to it (rank 1 inherits rank 0's stderr)
    with open(log, "w") as f:
        rank0 = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), "--steps", "6", "--kill-rank", "1",
                                  "--kill-at-step", "1", "--hang", "--timeout", "300"],
                                 env=e, stdout=subprocess.DEVNULL, stderr=f, preexec_fn=dies_with_this_process())
    marker, deadline = tmp_path / "killed_1", time.monotonic() + 240
    rank1 = None
    try:
        while not marker.exists() or not marker.read_text():
            assert rank0.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "rank 1 never reached its hang"
            time.sleep(0.2)
        rank1 = int(marker.read_text())
        assert not gone(rank1)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait()
        took = wait_gone(rank1, 5 + 10)
        assert took is not None, "rank 1 outlived local rank 0"
        err = log.read_text()
        assert f"megatrain: the process that started this one (pid {rank0.pid}) has ended and this one " \
               f"(pid {rank1}) did not stop within 5 s; killing it." in err, err[-4000:]
    finally:
        rank0.kill()
        if rank1 is not None and not gone(rank1):
            os.kill(rank1, signal.SIGKILL)
    assert running_with(str(tmp_path)) == []


def test_a_rank_whose_parent_ended_before_it_imported_the_package_exits():
    """The launcher's environment entry names a process that has already ended: importing the package exits at
    once (code 1, saying why) instead of training without it."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    proc = subprocess.run([sys.executable, "-c", "import megatrain_lightning; print('trained')"],
                          env={**os.environ, ENV: f"{ended.pid}:5"}, capture_output=True, text=True, timeout=120,
                          preexec_fn=dies_with_this_process())
    assert proc.returncode == 1 and "trained" not in proc.stdout, proc.stderr[-3000:]
    assert f"megatrain: the process that started this one (pid {ended.pid}) has already ended; exiting." in proc.stderr
    assert parent_env(5.0) == {ENV: f"{os.getpid()}:5"}


def test_peers_name_a_dead_process_of_this_host():
    """Two live processes and one that ended (a zombie until reaped, then gone): only that one is dead, and a
    transport error becomes a PeerFailure naming it."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=dies_with_this_process())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    peers = Peers.local(3, 0, [os.getpid(), live.pid, gone.pid])
    while gone.poll() is None:
        time.sleep(0.05)
    try:
        assert peers.dead() == [2]
        err = peers.explain(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), "the gradient all-reduce", 20)
        assert isinstance(err, PeerFailure)
        assert str(err).startswith(f"megatrain: rank 2 stopped responding: its process (pid {gone.pid} on ")
        assert "Connection closed by peer" in str(err)
        with pytest.raises(PeerFailure, match="rank 2 stopped responding"):
            with peers.guard("a barrier"):
                raise RuntimeError("Connection reset by peer")
        with pytest.raises(PeerFailure, match="rank 2 stopped responding"):  # after a failure: at once, no collective
            with peers.guard("a barrier"):
                raise AssertionError("not reached")
    finally:
        live.kill()
        live.wait()
    # nobody on this host died (rank 1 on another host): the message says where to look, and the timeout
    peers = Peers(0, [peers.hosts[0], "other-host"], [os.getpid(), 1], ["x", "y"], settle_s=0.0)
    with pytest.raises(RuntimeError, match="^Tensors must be contiguous$"):  # not about the peers: unchanged
        with peers.guard("a barrier"):
            raise RuntimeError("Tensors must be contiguous")
    assert peers.failure is None
    msg = str(peers.explain(RuntimeError("Timed out waiting 20000ms"), "a barrier", 20))
    assert "one of ranks 1 on other hosts died, or a rank hangs" in msg and "(20 s, the strategy's timeout=)" in msg


def test_a_rank_waiting_for_a_dead_owner_stops_before_the_timeout():
    """A rank waiting in shared memory for a slab's owner (``SlabOwnership.wait``) looks about once a second
    whether the owner's process has exited, and then stops with an error naming it instead of waiting 60 s."""
    counts = torch.zeros(1, dtype=torch.int64)
    own = SlabOwnership([0], 1, counts, timeout_s=60, global_rank_of=lambda r: 4 + r, all_reduce=lambda t, op: None,
                        sync=lambda: None, exited=lambda rank: rank == 4)
    t0 = time.monotonic()
    with pytest.raises(OwnerTimeout, match=r"rank 4 \(local rank 0\), which updates slab 0, did not publish update 1: its process has exited"):
        own.wait(0)
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------------------------------------- rendezvous
class _Env:
    def __init__(self, external: bool):
        self.creates_processes_externally = external


@pytest.mark.parametrize("env, devices, nodes, match", [
    ({"WORLD_SIZE": "3"}, 2, 1, r"WORLD_SIZE=3 but Trainer\(devices=2, num_nodes=1\) makes 2 processes"),
    ({"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "2"}, 2, 2, r"NODE_RANK=2 but Trainer\(num_nodes=2\) has nodes 0..1"),
    ({"MASTER_ADDR": "10.0.0.1"}, 2, 2, r"num_nodes=2\) but NODE_RANK is not set"),
    ({"NODE_RANK": "1"}, 2, 2, r"num_nodes=2\) but MASTER_ADDR is not set"),
    ({}, 1, 2, r"MASTER_ADDR and NODE_RANK are not set"),
    ({"MASTER_PORT": "70000"}, 2, 1, r"MASTER_PORT=70000 is not a port number"),
])
def test_inconsistent_rendezvous_settings_are_refused(env, devices, nodes, match):
    with pytest.raises(RendezvousError, match=match):
        check_rendezvous(env, _Env(False), devices, nodes)


def test_consistent_rendezvous_settings_pass():
    check_rendezvous({}, _Env(False), 2, 1)
    check_rendezvous({"MASTER_ADDR": "127.0.0.1", "NODE_RANK": "1", "MASTER_PORT": "29500"}, _Env(False), 2, 2)
    check_rendezvous({"WORLD_SIZE": "4", "GROUP_RANK": "1"}, _Env(True), 2, 2)  # torchrun sets these


def test_trainer_refuses_two_nodes_without_a_rendezvous(monkeypatch):
    """Through Lightning's connector: the check runs when the strategy picks its launcher, at ``Trainer(...)``,
    before any process is started or anything allocated."""
    for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RendezvousError, match=r"MASTER_ADDR and NODE_RANK are not set"):
        pl.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", devices=2, num_nodes=2, logger=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RendezvousError, match=r"WORLD_SIZE=2 but Trainer\(devices=1, num_nodes=1\) makes 1"):
        pl.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", devices=1, logger=False)


# ---------------------------------------------------------------------------------------------- mismatched ranks
def test_differences_list_each_key_with_its_ranks():
    fps = [{"a": "1", "b": "x"}, {"a": "1", "b": "y"}, {"a": "2", "b": "x"}]
    diff = differences(fps)
    assert diff == {"a": {"1": [0, 1], "2": [2]}, "b": {"x": [0, 2], "y": [1]}}
    msg = mismatch_message(diff)
    assert "  a: 1 on ranks 0, 1; 2 on rank 2" in msg and "  b: x on ranks 0, 2; y on rank 1" in msg
    assert differences([{"a": "1"}, {"a": "1"}]) == {}


def test_fingerprint_sees_the_model_and_options_not_where_the_model_came_from():
    """Same config loaded from another path (node-local copies): the same fingerprint. One more layer: the config
    and the parameters differ; another lookahead or accumulation: those keys differ."""
    trainer = types.SimpleNamespace(precision="bf16-mixed", accumulate_grad_batches=2)
    a, b = T.make_model("llama"), T.make_model("llama")
    b.config._name_or_path = "/local/copy/of/the/model"
    fa = run_fingerprint(a, MegaTrainStrategy(), trainer)
    assert fa == run_fingerprint(b, MegaTrainStrategy(), trainer)
    assert fa["trainer.precision"] == "'bf16-mixed'" and fa["strategy.lookahead"] == "1"
    deeper = T.make_model("llama", num_hidden_layers=a.config.num_hidden_layers + 1)
    fb = run_fingerprint(deeper, MegaTrainStrategy(lookahead=2), types.SimpleNamespace(precision="bf16-mixed",
                                                                                        accumulate_grad_batches=3))
    assert set(differences([fa, fb])) == {"model config", "parameters", "strategy.lookahead",
                                          "trainer.accumulate_grad_batches"}


def test_optimizer_fingerprint_sees_learning_rate_groups_and_schedulers():
    model = T.make_model("llama")
    params = list(model.parameters())

    def fp(lr: float, split: int, sched: bool):
        opt = torch.optim.AdamW([{"params": params[:split]}, {"params": params[split:], "weight_decay": 0.0}], lr=lr)
        cfgs = [types.SimpleNamespace(scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10), interval="step",
                                      frequency=1)] if sched else []
        return optimizer_fingerprint(opt, cfgs)

    base = fp(1e-3, 4, True)
    assert base == fp(1e-3, 4, True)
    assert base["optimizer.group1.weight_decay"] == "0.0" and base["scheduler0"].startswith("CosineAnnealingLR")
    assert set(differences([base, fp(2e-3, 4, True)])) == {"optimizer.group0.lr", "optimizer.group1.lr"}
    assert set(differences([base, fp(1e-3, 5, True)])) == {"optimizer.group0.params", "optimizer.group1.params"}
    assert set(differences([base, fp(1e-3, 4, False)])) == {"scheduler0"}


def test_ranks_with_different_models_and_options_are_refused(tmp_path):
    """Rank 1 builds a model with one more layer and accumulates one more micro-batch: both ranks stop at setup,
    before the store is built, listing every differing key with its values and ranks."""
    proc = launch(tmp_path, "--steps", "2", "--mismatch", "model,accumulate,lookahead", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ConfigMismatchError: megatrain: the ranks of this run were started with different configurations" in out, \
        out[-4000:]
    assert "trainer.accumulate_grad_batches: 2 on rank 0; 3 on rank 1" in out
    assert "strategy.lookahead: 1 on rank 0; 2 on rank 1" in out
    assert "  model config: " in out and "  parameters: " in out
    assert "  torch: " not in out and "trainer.precision" not in out  # only what differs
    assert running_with(str(tmp_path)) == []


def test_ranks_with_different_learning_rates_are_refused_before_the_first_step(tmp_path):
    """Rank 1's configure_optimizers returns twice the learning rate: each slab's owner would apply its own, so
    both ranks stop once the optimizers are made, before the first step, naming the key and the ranks."""
    proc = launch(tmp_path, "--steps", "2", "--mismatch", "lr", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "  optimizer.group0.lr: 0.001 on rank 0; 0.002 on rank 1" in out, out[-4000:]
    assert "[rank0]: megatrain_lightning.parallel.preflight.ConfigMismatchError" in out
    assert not (tmp_path / "losses_0.pt").exists()
    assert running_with(str(tmp_path)) == []


def test_ranks_with_different_numbers_of_batches_are_refused_before_the_first_step(tmp_path):
    """``use_distributed_sampler=False`` and rank 1 with twice rank 0's batches (one epoch): rank 0 ended its epoch
    and waited at the end of fit for updates rank 1 publishes only in its next step, until ``timeout``, then blamed
    the live rank 1 ("did not publish update 2"). Now both ranks stop before the first step with the counts."""
    t0 = time.monotonic()
    proc = launch(tmp_path, "--steps", "-1", "--n", "8", "--unequal-batches", "--timeout", "600", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - t0 < 120
    assert "different numbers of training batches per epoch (4 on rank 0; 8 on rank 1" in out, out[-4000:]
    assert "[rank0]: megatrain_lightning.parallel.preflight.ConfigMismatchError" in out
    assert not (tmp_path / "losses_0.pt").exists()
    assert running_with(str(tmp_path)) == []


# ---------------------------------------------------------------------------------------------- /dev/shm
def test_check_shm_says_the_numbers_and_what_to_change(monkeypatch):
    real = os.statvfs

    class Small:
        f_frsize, f_blocks, f_bavail = 4096, 16384, 16384  # a 64 MiB tmpfs (Docker's default), all free

    monkeypatch.setattr(os, "statvfs", lambda p: Small() if p == "/dev/shm" else real(p))
    check_shm(64 * 2**20)  # exactly fits
    with pytest.raises(SharedMemoryTooSmall, match=r"needs 1\.00 GiB of shared memory in /dev/shm, which has 64\.00 MiB "
                                                   r"free \(of 64\.00 MiB\).*--shm-size"):
        check_shm(2**30)


def test_too_small_dev_shm_on_one_rank_stops_every_rank(tmp_path):
    """Local rank 1 sees 4 KiB free in /dev/shm: every rank stops before the shared file is created, with the
    numbers and the ranks concerned (rank 0 would otherwise wait for rank 1 in a barrier)."""
    proc = launch(tmp_path, "--steps", "2", "--shm-free", "4096", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "SharedMemoryTooSmall: megatrain: shared memory too small on node 0 (ranks 1); nothing was allocated." \
        in out, out[-4000:]
    assert "which has 4.00 KiB free (of 4.00 KiB)" in out and "--shm-size" in out
    assert "[rank0]: megatrain_lightning.store.shared.SharedMemoryTooSmall" in out  # rank 0 stops too, not waiting
    assert running_with(str(tmp_path)) == []
