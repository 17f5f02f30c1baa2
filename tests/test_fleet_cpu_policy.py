"""The fleet's CPU policies (tokenloom/fleet/cpu_policy.py): Ray's processes at SCHED_BATCH, an engine
replica's threads back at SCHED_OTHER. Real processes and threads, no Ray."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tokenloom.fleet import cpu_policy

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")


RAYLET = textwrap.dedent("""
    import os, subprocess, sys
    helper = subprocess.Popen(["sleep", "60"])  # a daemon it started before
    print(helper.pid, flush=True)
    sys.stdin.readline()  # its policy is set meanwhile
    worker = subprocess.Popen(["sleep", "60"])  # a worker it starts afterwards
    print(os.sched_getscheduler(worker.pid), flush=True)
    sys.stdin.readline()
    helper.kill(); worker.kill()
""")


def test_ray_gives_way_sets_its_processes_and_the_workers_they_start_later_inherit_it():
    raylet = subprocess.Popen([sys.executable, "-c", RAYLET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        helper = int(raylet.stdout.readline())
        assert cpu_policy.descendants(raylet.pid) == [helper]
        cpu_policy.ray_gives_way([raylet.pid, *cpu_policy.descendants(raylet.pid)])
        assert os.sched_getscheduler(raylet.pid) == os.sched_getscheduler(helper) == os.SCHED_BATCH
        raylet.stdin.write("\n")
        raylet.stdin.flush()
        assert int(raylet.stdout.readline()) == os.SCHED_BATCH
    finally:
        raylet.stdin.write("\n")
        raylet.stdin.close()
        raylet.wait(10)


ENGINE_REPLICA = textwrap.dedent("""
    import json, os, threading
    from tokenloom.fleet import cpu_policy
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # as started by a SCHED_BATCH raylet
    ready, done = threading.Event(), threading.Event()
    loop = threading.Thread(target=lambda: (ready.set(), done.wait()))  # Ray's threads, started earlier
    loop.start(); ready.wait()
    cpu_policy.engine_takes_cores()
    policies = {}
    def engine():  # started afterwards by a non-main thread, as the engine's step thread is
        policies["engine"] = os.sched_getscheduler(0)
    def start_engine():
        t = threading.Thread(target=engine); t.start(); t.join()
        policies["loop"] = os.sched_getscheduler(0)
    t = threading.Thread(target=start_engine); t.start(); t.join()
    policies["earlier"] = os.sched_getscheduler(loop.native_id)
    policies["main"] = os.sched_getscheduler(0)
    done.set(); loop.join()
    print(json.dumps(policies))
""")


def test_an_engine_replica_started_by_a_batch_raylet_takes_its_cores_back():
    out = subprocess.run([sys.executable, "-c", ENGINE_REPLICA], capture_output=True, text=True, check=True)
    policies = json.loads(out.stdout)
    assert policies == {"engine": os.SCHED_OTHER, "loop": os.SCHED_OTHER, "earlier": os.SCHED_OTHER,
                        "main": os.SCHED_OTHER}, policies
