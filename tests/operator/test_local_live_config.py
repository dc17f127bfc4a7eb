"""The local kubelet mounts the live-config ConfigMap as a cluster's kubelet does: a replica started
after a live change gets the values in force through ``--live-config-file``."""

from __future__ import annotations

import asyncio
import copy
import json
import logging

from kvpilot.operator.api import names
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.local.api import LocalApi
from kvpilot.operator.local.process import Replica
from kvpilot.operator.local.replicas import LocalKubelet
from kvpilot.operator.render.builders import build_deployment, build_live_config


def test_a_replica_started_after_a_live_change_gets_its_values(make_isvc, tmp_path, monkeypatch):
    started: list[list[str]] = []
    monkeypatch.setattr(Replica, "start", lambda self: started.append(list(self.args)))
    isvc = make_isvc(engine={"maxNumSeqs": 64})
    api = LocalApi()
    kubelet = LocalKubelet(api, "llm", "llama", tmp_path, gpu=False, logger=logging.getLogger("test"))
    deployment = build_deployment(resolve(isvc))

    kubelet._create(deployment, 0.0)  # no ConfigMap yet: no file, the start-up values
    (args,) = started
    path = args[args.index(names.LIVE_CONFIG_FLAG) + 1]
    assert path == str(kubelet.live_config_file) and not kubelet.live_config_file.exists()

    lowered = copy.deepcopy(isvc)
    override = {"value": 30, "specValue": 64, "reason": "storm"}
    lowered["status"] = {"effective": {"overrides": {"maxNumSeqs": override}}}
    asyncio.run(api.apply(build_live_config(resolve(lowered))))
    assert build_deployment(resolve(lowered)) == deployment, "the same template: no rollout"
    kubelet._create(deployment, 1.0)  # a scale-up (or a restart) after the live change
    assert json.loads(kubelet.live_config_file.read_text()) == {"max_num_seqs": 30}
    assert started[1][started[1].index(names.LIVE_CONFIG_FLAG) + 1] == path
