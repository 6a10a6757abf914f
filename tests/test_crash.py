"""Crashes the trainer cannot plan for: SIGKILL while a checkpoint is being written, a port taken by
someone else, and payloads built to execute code when unpickled."""

from __future__ import annotations

import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hivemind.proto import runtime_pb2

from p2p_spes.averaging.transport import TransportError, parse_tensor
from p2p_spes.checkpoint import find_checkpoint, load_checkpoint, read_state
from p2p_spes.config import load_config
from p2p_spes.model import MoETransformer

BIG = ["model.d_model=256", "model.num_layers=4", "model.num_heads=4", "moe.num_experts=8", "moe.ffn_dim=512"]

WRITER = textwrap.dedent("""
    import sys
    from p2p_spes.checkpoint import save_checkpoint
    from p2p_spes.config import load_config
    from p2p_spes.model import MoETransformer
    from p2p_spes.optim import build_optimizer
    cfg = load_config(None, sys.argv[2:])
    model = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)))
    model.init_weights(0)
    opt = build_optimizer(model, cfg.train)
    step = int(sys.argv[1])
    while True:  # write checkpoint after checkpoint until killed
        step += 1
        save_checkpoint("RUN", step, model, opt, {"model_fingerprint": cfg.model_fingerprint()})
""")


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_always_leaves_a_complete_checkpoint(tmp_path):
    rng = random.Random(0)
    script = WRITER.replace('"RUN"', repr(str(tmp_path)))
    cfg = load_config(None, BIG)
    step = 0
    for attempt in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(step), *BIG], start_new_session=True, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 120
        while find_checkpoint(tmp_path) is None or read_state(find_checkpoint(tmp_path))["step"] <= step:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the writer made no checkpoint"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))  # somewhere inside a later write
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        path = find_checkpoint(tmp_path)
        state = read_state(path)  # checksums of every file verified
        assert state["step"] > step
        step = state["step"]
        model = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)))
        load_checkpoint(path, model, fingerprint=cfg.model_fingerprint())
    leftovers = list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert leftovers, "the kills should have interrupted at least one write (else the test proves nothing)"


@pytest.mark.slow
def test_a_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "p2p_spes",
                "train",
                "--run-dir",
                str(tmp_path),
                "--swarm",
                "--host-maddrs",
                f"/ip4/127.0.0.1/tcp/{port}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"port {port} on 127.0.0.1 is in use" in proc.stderr


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("dtype", ["float32", "object", "int64"])
@pytest.mark.parametrize("compression", ["NONE", "FLOAT16", "UNIFORM_8BIT"])
def test_pickles_in_tensor_messages_are_refused_unloaded(tmp_path, dtype, compression):
    """What our RPC handlers do with every received tensor: bytes built to run code when unpickled
    are refused as a malformed tensor, under every dtype and codec tag a sender can claim."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(str(marker)))
    forged = runtime_pb2.Tensor(
        buffer=payload,
        size=[len(payload) // 4],
        dtype=dtype,
        compression=getattr(runtime_pb2.CompressionType, compression),
    )
    try:  # read as raw numbers (harmless) or refused; never unpickled
        parse_tensor([forged], (len(payload) // 4,), torch.float32)
    except TransportError as exc:
        refused = str(exc)
    else:
        refused = ""
        assert dtype != "object", "an object array can only come from unpickling"
    assert not marker.exists(), f"a pickle from the network was loaded ({refused})"


@pytest.mark.parametrize("writer", ["write_json", "write_text"])
def test_a_reader_polling_an_address_file_never_sees_half_of_it(tmp_path, writer):
    """peer.json and bootstrap.json are polled by the launcher while the peer writes them: a reader that
    saw the file exist must parse all of it (a half-written file once failed a swarm's start)."""
    import json
    import threading

    from p2p_spes.checkpoint import write_json

    path = tmp_path / "peer.json"
    data = {"peer_id": "Qm" + "x" * 44, "maddrs": [f"/ip4/127.0.0.1/tcp/{port}/p2p/Qm" for port in range(2000)]}
    stop = threading.Event()

    def write() -> None:
        for _ in range(300):
            if writer == "write_json":
                write_json(path, data)
            else:
                path.write_text(json.dumps(data))
        stop.set()

    thread = threading.Thread(target=write)
    thread.start()
    torn = 0
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        if path.exists():
            try:
                assert json.loads(path.read_text())["maddrs"] == data["maddrs"]
            except json.JSONDecodeError:
                torn += 1
    thread.join(60)
    if writer == "write_json":
        assert torn == 0
        assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    else:
        assert torn > 0, "a plain write should be caught half-written (else the test proves nothing)"


FORKER = textwrap.dedent("""
    import asyncio, multiprocessing, os, signal, sys, time
    from dht.node import sigterm_as_interrupt

    def child():  # like hivemind's DHT process: an event loop forked after the handler was installed
        asyncio.run(asyncio.sleep(60))

    if sys.argv[1] == "ours":
        sigterm_as_interrupt()
    else:  # what the peer and the dashboard did before: raise in whichever process receives it
        def interrupt(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, interrupt)
    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    time.sleep(1.0)
    proc.terminate()  # hivemind's shutdown does this when its process outlives the grace period
    proc.join(10)
    print("child exit", proc.exitcode, flush=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("parent not interrupted", flush=True)
    except KeyboardInterrupt:
        print("parent interrupted", flush=True)
""")


@pytest.mark.parametrize("handler", ["ours", "raise-everywhere"])
def test_sigterm_interrupts_the_process_that_asked_and_ends_its_forked_children_quietly(handler):
    """The dashboard's CI failure: its DHT process, forked after the SIGTERM handler was installed,
    printed a KeyboardInterrupt traceback from inside hivemind's event loop when it was terminated."""
    out = subprocess.run([sys.executable, "-c", FORKER, handler], capture_output=True, text=True, timeout=60)
    assert "parent interrupted" in out.stdout, out.stderr
    if handler == "ours":
        assert f"child exit {-signal.SIGTERM}" in out.stdout and "Traceback" not in out.stderr, out.stderr
    else:  # the old handler: the child raised inside its loop, so this test can tell them apart
        assert "KeyboardInterrupt" in out.stderr and f"child exit {-signal.SIGTERM}" not in out.stdout
