"""``kubectl drain`` of a node as a process, watched: the engine pods Ready and the engine budget's status over time,
and, when an assertion about them fails, what the cluster says about why (:func:`explain`).

A drain's assertion that fails on a loaded machine must explain itself: which pod stopped being Ready and how
(evicted: a ``DisruptionTarget`` condition by the Eviction API; its node lost: ``Ready`` False with the node lifecycle
controller's reason), what the disruption controller counted when it let an eviction through (``expectedPods``,
``currentHealthy``, ``desiredHealthy``, ``disruptionsAllowed``), the nodes' heartbeat and the namespace's events.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

from .real_fleet import Fleet

#: What ``kubectl drain`` prints for an eviction the budget refused (the Eviction API's 429); it retries after 5 s.
REFUSED = "would violate the pod's disruption budget"
#: Seconds between the watcher's samples: far finer than the drain's 5 s retries and kwok's sub-second replacements,
#: and a pace of its own (an in-process read takes ~3 ms; unpaced, the watcher kept the API server busy with ~1,400
#: reads a drain, where a kubectl process per read used to pace it at ~50).
SAMPLE_INTERVAL = 0.05


def ready(pod: dict[str, Any]) -> bool:
    """Ready and not going (a pod being deleted counts as gone, as the disruption controller counts it)."""
    return "deletionTimestamp" not in pod["metadata"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))


def _conditions(obj: dict[str, Any]) -> str:
    return " ".join(f"{c['type']}={c['status']}@{c.get('lastTransitionTime', '?')}"
                    + (f"({c['reason']})" if c.get("reason") else "")
                    for c in (obj.get("status") or {}).get("conditions") or [])


def _budget_status(budget: dict[str, Any] | None) -> str:
    if budget is None:
        return "no budget"
    status = budget.get("status") or {}
    return (f"allowed {status.get('disruptionsAllowed')}, healthy {status.get('currentHealthy')}, desired "
            f"{status.get('desiredHealthy')}, expected {status.get('expectedPods')}, disrupted "
            f"{sorted(status.get('disruptedPods') or {})}")


class Drain:
    """``kubectl drain NODE`` as a process whose output is read as it comes, and a watcher that samples the engine
    pods of resource ``name`` and budget ``budget`` meanwhile: the Ready counts, and a timeline of every change."""

    def __init__(self, fleet: Fleet, node: str, name: str, budget: str):
        self.fleet, self.node, self.name, self.budget = fleet, node, name, budget
        kubectl = fleet.kubectl
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "drain", node, "--ignore-daemonsets",
             "--delete-emptydir-data", "--timeout=240s"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.samples: list[tuple[float, int]] = []  # (when the sample began, engine pods Ready in it)
        self.timeline: list[str] = []  # "+seconds: Ready pods; every engine pod; the budget", at each change
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.reader.start()
        self.watcher.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(f"+{time.monotonic() - self.started:.2f}s {line}")

    def _watch(self) -> None:
        last = ""
        while self.process.poll() is None:
            began = time.monotonic()
            try:
                pods, budget = self.sample()
            except AssertionError as exc:  # kubectl failed (a loaded API server): the next sample tells
                self.timeline.append(f"+{began - self.started:.2f}s sample failed: {exc}")
                time.sleep(SAMPLE_INTERVAL)
                continue
            self.samples.append((began, sum(map(ready, pods))))
            state = (f"Ready {sorted(p['metadata']['name'] for p in pods if ready(p))}; pods "
                     + ", ".join(f"{p['metadata']['name']} {(p.get('status') or {}).get('phase')}"
                                 + (" deleting" if "deletionTimestamp" in p["metadata"] else "") for p in pods)
                     + f"; budget {_budget_status(budget)}")
            if state != last:
                self.timeline.append(f"+{time.monotonic() - self.started:.2f}s {state}")
                last = state
            time.sleep(SAMPLE_INTERVAL)

    def sample(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The engine pods and the budget, read in one request."""
        items = self.fleet.kubectl.get("pods,poddisruptionbudgets")
        pods = [i for i in items if i["kind"] == "Pod"
                and (i["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == self.name
                and i["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
        budget = next((i for i in items if i["kind"] == "PodDisruptionBudget" and i["metadata"]["name"] == self.budget),
                      None)
        return pods, budget

    @property
    def ready_counts(self) -> list[int]:
        return [count for _, count in self.samples]

    def sampled_since(self, moment: float) -> list[int]:
        """The Ready counts of the samples that began at ``moment`` or later (a sample in flight at ``moment`` may
        have read the pods before it)."""
        return [count for began, count in list(self.samples) if began >= moment]

    def ready_now(self) -> int:
        return sum(ready(p) for p in self.fleet.engine_pods(self.name))

    def output(self) -> str:
        return "".join(self.lines)

    def refusals(self) -> int:
        return self.output().count(REFUSED)

    def stop(self) -> None:
        """End a drain that cannot finish (its evictions refused for good)."""
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=30)
        self.reader.join(timeout=30)
        self.watcher.join(timeout=30)

    def finish(self, label: str) -> tuple[int, str]:
        self.process.wait(timeout=300)
        self.reader.join(timeout=30)
        self.watcher.join(timeout=30)
        print(f"{label}: drain exit {self.process.returncode}; fewest engine groups Ready at once "
              f"{min(self.ready_counts, default=-1)} over {len(self.ready_counts)} samples; evictions refused by the "
              f"budget: {self.refusals()}")
        return self.process.returncode, self.output()

    def explain(self) -> str:
        """What the cluster says now and what the watcher saw, for an assertion's message."""
        kubectl = self.fleet.kubectl
        pods, budget = self.sample()
        lines = ["timeline (from the drain's start):", *self.timeline, "engine pods now:"]
        lines += [f"  {p['metadata']['name']} on {p['spec'].get('nodeName')} {(p.get('status') or {}).get('phase')}"
                  f"{' deleting' if 'deletionTimestamp' in p['metadata'] else ''}: {_conditions(p)}" for p in pods]
        lines.append(f"budget {self.budget}: spec {json.dumps((budget or {}).get('spec'))}; {_budget_status(budget)}")
        for node in kubectl.get("nodes", None, f"-l=megatron.test/pool={kubectl.namespace}"):
            lease = kubectl.run("get", "lease", "-n", "kube-node-lease", node["metadata"]["name"], "-o",
                                "jsonpath={.spec.renewTime}", check=False).stdout
            lines.append(f"node {node['metadata']['name']}: unschedulable {node['spec'].get('unschedulable', False)}, "
                         f"taints {[t['key'] for t in node['spec'].get('taints', [])]}, lease renewed {lease}, "
                         + " ".join(f"{c['type']}={c['status']} heartbeat {c.get('lastHeartbeatTime')} since "
                                    f"{c.get('lastTransitionTime')} ({c.get('reason')})"
                                    for c in (node.get("status") or {}).get("conditions", []) if c["type"] == "Ready"))
        node_events = kubectl.run("get", "events", "-n", "default", f"--field-selector=involvedObject.name={self.node}",
                                  "-o", "json", check=False)  # a node's events are recorded in namespace default
        events = kubectl.get("events")
        if node_events.returncode == 0:
            events += json.loads(node_events.stdout)["items"]
        lines.append("events:")
        lines += [f"  {e.get('lastTimestamp') or e.get('eventTime')} {e['involvedObject']['kind']}/"
                  f"{e['involvedObject']['name']} {e.get('reason')}: {e.get('message')}"
                  for e in sorted(events, key=lambda e: e.get("eventTime") or e.get("lastTimestamp") or "")]
        lines += ["kubectl drain:", self.output()]
        return "\n".join(lines)
