"""serve_app.http.model_states: each model's state from what Serve says of its deployment, the replica's
own error in one line, and a failure logged once. (Through Ray Serve:
tests/integration/serving/test_serving_failure.py.)"""

from __future__ import annotations

import asyncio
import logging

from serve_app.http.model_states import (
    DeploymentView,
    ModelState,
    ModelStates,
    replica_error,
    state_of,
)

SERVE_MESSAGE = (
    "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
    "initial health check failing. See controller logs for details. Error:\n"
    "\x1b[36mray::ServeReplica:llm:TextServer-bad.initialize_and_get_metadata()\x1b[39m "
    "(pid=24940, ip=192.0.2.2, actor_id=ab12)\n"
    "  File \"/work/main/serve_app/replica.py\", line 48, in _start\n"
    "    self.prompts = PromptTokenizer(str(model_dir), config.model_id)\n"
    "  File \"/venv/transformers/models/auto/tokenization_auto.py\", line 1153, in from_pretrained\n"
    "    raise ValueError(\n"
    "ValueError: Tokenizer class NoSuchTokenizer does not exist or is not currently imported."
)


def test_the_replicas_own_error_in_one_line():
    assert replica_error(SERVE_MESSAGE) == (
        "ValueError: Tokenizer class NoSuchTokenizer does not exist or is not currently imported.")
    assert replica_error("json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)") == (
        "JSONDecodeError: Expecting value: line 1 column 1 (char 0)")
    assert replica_error("Deploying: 1 replica starting") is None


def test_states_from_serve():
    assert state_of(DeploymentView("HEALTHY", "", 1)) == ModelState("ready")
    assert state_of(DeploymentView("UPDATING", "", 1)) == ModelState("ready")  # one replica serves already
    assert state_of(DeploymentView("UPDATING", "", 0)) == ModelState("starting")
    assert state_of(DeploymentView("UNHEALTHY", SERVE_MESSAGE, 0)).state == "starting"  # being replaced
    assert state_of(None) == ModelState("starting")  # not deployed yet
    failed = state_of(DeploymentView("DEPLOY_FAILED", SERVE_MESSAGE, 0))
    assert failed == ModelState("failed", replica_error(SERVE_MESSAGE))
    assert failed.problem("bad") == (
        "model 'bad' failed to start: ValueError: Tokenizer class NoSuchTokenizer does not exist or is not "
        "currently imported.; fix its configuration and redeploy")
    retrying = state_of(DeploymentView("UPDATING", SERVE_MESSAGE, 0))
    assert retrying.state == "starting" and retrying.problem("bad").startswith(
        "model 'bad' is starting (loading and compiling) (retrying after: ValueError: Tokenizer class")
    assert ModelState("ready").problem("good") is None


def test_each_failure_is_logged_once_and_a_ready_model_never_waits_for_serve(caplog):
    views = {"TextServer-good": DeploymentView("HEALTHY", "", 1),
             "TextServer-bad": DeploymentView("UPDATING", "", 0)}
    calls = []

    def fetch():
        calls.append(1)
        return dict(views)

    states = ModelStates({"good": "TextServer-good", "bad": "TextServer-bad"}, fetch)

    async def refreshed() -> dict[str, ModelState]:
        return await states.refresh()  # what the watcher does every interval

    with caplog.at_level(logging.ERROR, logger="serve_app.http.model_states"):
        assert asyncio.run(refreshed())["bad"] == ModelState("starting")
        views["TextServer-bad"] = DeploymentView("DEPLOY_FAILED", SERVE_MESSAGE, 0)
        for _ in range(3):
            assert asyncio.run(refreshed())["bad"].state == "failed"
        views["TextServer-bad"] = DeploymentView("UPDATING", SERVE_MESSAGE, 0)  # as if redeployed
        asyncio.run(refreshed())
    assert len(calls) == 5
    reason = replica_error(SERVE_MESSAGE)
    assert [r.message for r in caplog.records] == [
        f"model 'bad' failed to start and Serve gave up: {reason}; fix its configuration and redeploy",
        f"model 'bad' failed to start: {reason}; Serve retries it (a checkpoint or config error fails again: fix "
        "the model's entry)"]
    for _ in range(3):
        assert asyncio.run(states.get("good")) == ModelState("ready")
    assert len(calls) == 5  # a ready model's requests do not ask Serve


def test_without_an_answer_from_serve_the_last_states_hold():
    answers = [{"TextServer-m": DeploymentView("HEALTHY", "", 1)}]

    def fetch():
        if not answers:
            raise ConnectionError("the controller is restarting")
        return answers.pop()

    states = ModelStates({"m": "TextServer-m", "new": "TextServer-new"}, fetch)

    async def scenario() -> tuple[dict, dict]:
        first = await states.refresh()
        return first, await states.refresh()

    first, second = asyncio.run(scenario())
    assert first == second == {"m": ModelState("ready"), "new": ModelState("starting")}
    never_asked = ModelStates({"m": "TextServer-m"}, fetch)
    assert asyncio.run(never_asked.get("m")) == ModelState("ready")  # Serve routes it as it would


def test_a_model_not_ready_is_asked_again_before_a_request_is_refused():
    """The watcher's last answer may predate the replica's start by up to an interval: a request
    for a model that answer calls starting gets an answer asked after it arrived."""
    views = {"TextServer-m": DeploymentView("UPDATING", "", 0)}
    states = ModelStates({"m": "TextServer-m"}, lambda: dict(views), interval_s=3600.0)

    async def scenario() -> tuple[ModelState, ModelState]:
        before = await states.get("m")
        views["TextServer-m"] = DeploymentView("HEALTHY", "", 1)  # started since
        return before, await states.get("m")

    assert asyncio.run(scenario()) == (ModelState("starting"), ModelState("ready"))
