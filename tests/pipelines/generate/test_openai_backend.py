"""``backend: openai`` against a real HTTP endpoint on loopback: a stdlib server in this test that
serves the reference target (chat template server-side, as vLLM does). Its answers must be the
in-process backend's, with retries on 503, a 400 rejected as the record's fault, and a dead
server stopping the run for a later resume."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hsstore.storage import StoreLocation
from pipelines.generate.driver import run_generation
from pipelines.generate.manifest import GenerationError, read_manifest
from pipelines.generate.recipe import GenerateRecipe
from pipelines.recipe import build_recipe

pytestmark = pytest.mark.slow

RECORDS = [
    {"id": "chat", "messages": [{"role": "system", "content": "You are a Python coding assistant."},
                                {"role": "user", "content": "Continue this Python file:\nimport os\n\n\ndef walk(root):\n"}]},
    {"id": "two", "messages": [{"role": "user", "content": "Continue this Python file:\nclass Queue:\n"},
                               {"role": "assistant", "content": "old"},
                               {"role": "user", "content": "More."}]},
    {"id": "text", "text": "import json\nimport sys\n\n\ndef load(path):\n    with open(path) as handle:\n        return json.load(handle)\n"},
    {"id": "refused", "messages": [{"role": "user", "content": "REFUSE this one"}]},
]


class TargetServer:
    """A minimal OpenAI-compatible server of the reference target (greedy), on 127.0.0.1."""

    def __init__(self, target: Path, fail_first: int = 0) -> None:
        from transformers import AutoTokenizer

        from pipelines.extract.target import load_target
        from pipelines.generate.engine import BatchGenerator, SamplingParams

        self.tokenizer = AutoTokenizer.from_pretrained(target)
        model = load_target(str(target), dtype="float32", device="cpu")
        self.generator = BatchGenerator(
            model, self.tokenizer, stop_token_ids=[2], pad_token_id=0, params=SamplingParams(),
            max_batch_size=1, token_budget=1 << 16,
        )
        self.lock = threading.Lock()
        self.fail_first = fail_first
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = server.answer(self.path, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        from pipelines.generate.prompts import Request

        with self.lock:
            self.requests.append({"path": path, **body})
            if self.fail_first > 0:
                self.fail_first -= 1
                return 503, {"error": {"message": "warming up"}}
        if path == "/v1/chat/completions":
            if any("REFUSE" in m["content"] for m in body["messages"]):
                return 400, {"error": {"message": "refused by policy"}}
            prompt = self.tokenizer.apply_chat_template(
                body["messages"], tokenize=False, add_generation_prompt=True, **body.get("chat_template_kwargs", {})
            )
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif path == "/v1/completions":
            ids = self.tokenizer(body["prompt"], add_special_tokens=True)["input_ids"]
        else:
            return 404, {"error": {"message": f"no route {path}"}}
        with self.lock:
            tokens, finishes = self.generator.generate_ids([Request(tuple(ids), body["max_tokens"], body["seed"])])
        text = self.tokenizer.decode(tokens[0])
        finish = "length" if finishes[0] != "stop" else "stop"
        choice = {"message": {"role": "assistant", "content": text}} if "messages" in body else {"text": text}
        return 200, {"choices": [{**choice, "index": 0, "finish_reason": finish}],
                     "usage": {"completion_tokens": len(tokens[0])}}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server(reference_target: Path) -> Iterator[TargetServer]:
    served = TargetServer(reference_target)
    yield served
    served.close()


def recipe_for(data: Path, output: Path, target: Path, *overrides: str) -> GenerateRecipe:
    base = {
        "target": str(target),
        "data": [str(data)],
        "output": str(output),
        "model": {"dtype": "float32", "device": "cpu"},
        "prompting": {"text_prefix_tokens": 16, "max_context": 1024},
        "sampling": {"max_new_tokens": 10},
        "units": {"max_records": 2},
        "openai": {"max_in_flight": 3, "backoff_seconds": 0.01, "max_retries": 3},
    }
    return build_recipe(GenerateRecipe, base, list(overrides))


def rows_of(folder: Path) -> dict[str, dict[str, Any]]:
    manifest = read_manifest(StoreLocation(str(folder)))
    assert manifest is not None
    rows = [json.loads(line) for s in manifest.shards for line in (folder / s.path).read_text().splitlines()]
    return {r["id"]: r for r in rows}


def test_openai_backend_writes_what_the_local_backend_writes(server: TargetServer, reference_target: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    server.fail_first = 2  # two 503s: retried with backoff
    served = recipe_for(data, tmp_path / "served", reference_target, "backend=openai", f"openai.base_url={server.url}")
    summary = run_generation(served)
    assert summary.rejected == {"generation_error": 1} and summary.num_written == 3
    reject = json.loads((tmp_path / "served" / "rejects" / "u000001.jsonl").read_text())
    assert reject["source_id"] == "refused" and "HTTP 400" in reject["message"]
    paths = [r["path"] for r in server.requests]
    assert paths.count("/v1/completions") >= 1 and paths.count("/v1/chat/completions") >= 4
    assert all(r["temperature"] == 0.0 and r["max_tokens"] <= 10 for r in server.requests)

    local = recipe_for(data, tmp_path / "local", reference_target)
    run_generation(local)
    local_rows = rows_of(tmp_path / "local")
    assert local_rows.pop("refused")  # only the server refuses it
    assert rows_of(tmp_path / "served") == local_rows
    lineage = read_manifest(StoreLocation(str(tmp_path / "served"))).lineage  # type: ignore[union-attr]
    assert lineage.backend == "openai" and lineage.served_model == str(reference_target)

    # The same recipe again: everything committed, no request sent.
    sent = len(server.requests)
    again = run_generation(served)
    assert again.num_units_skipped == 2 and len(server.requests) == sent


def test_a_dead_server_stops_the_run_and_a_rerun_resumes(server: TargetServer, reference_target: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:3]))
    dead = recipe_for(data, tmp_path / "out", reference_target, "backend=openai", "openai.base_url=http://127.0.0.1:9/v1",
                      "openai.max_retries=1")
    with pytest.raises(GenerationError, match="failed 2 times"):
        run_generation(dead)
    manifest = read_manifest(StoreLocation(str(tmp_path / "out")))
    assert manifest is not None and not manifest.complete and manifest.shards == []
    alive = recipe_for(data, tmp_path / "out", reference_target, "backend=openai", f"openai.base_url={server.url}",
                       "openai.max_retries=1")
    assert run_generation(alive).num_written == 3
