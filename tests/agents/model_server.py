#!/usr/bin/env python3
"""A scripted model server on 127.0.0.1 for the real agent CLIs (tests/real_agents.rs).

It speaks what each CLI speaks, streaming as the real services do:
  anthropic   POST /v1/messages                     (Claude Code: ANTHROPIC_BASE_URL)
  chat        POST /v1/chat/completions             (Qwen Code: OPENAI_BASE_URL)
  responses   POST /v1/responses                    (Codex: a model provider's base_url)
  gemini      POST /v1beta/models/M:streamGenerateContent  (Gemini CLI: GOOGLE_GEMINI_BASE_URL)

The script is loopd's own workflow: the server reads which loopd action the prompt is for
("You are the develop step ...") and answers as a well-behaved agent would. A develop first calls
the CLI's file-writing tool to create TASK_ID.txt in the project, then, once the tool's result
comes back, ends with loopd's JSON result; every other action answers with its JSON result at once.

--fault makes every main request fail instead: 401 (bad key), 429 (with retry-after), 529
(overloaded), 500, or hang (accept the request, never answer); with --fault-for SECONDS, only
those that arrive within that long of the first main request. Requests are appended, one JSON
line each, to --log. The first line on stdout is the port.
"""

import argparse
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACTION = re.compile(r"You are the (\w+) step of an autonomous development loop")
TASK = re.compile(r"# Your task now: (task-\d+)")

RESULTS = {
    "planning": {
        "status": "success",
        "summary": "planned two tasks",
        "state_updates": {
            "tasks": [{"description": "write the first file"}, {"description": "write the second file"}]
        },
    },
    "validate": {"status": "success", "summary": "all checks pass", "state_updates": {"passed": True, "pass_rate": 100}},
    "debug": {"status": "success", "summary": "nothing to debug"},
    "final": {"status": "success", "summary": "done", "state_updates": {"summary": "both files written"}},
}

# Usage reported for every answer: what the tests expect to find in loopd's events.
INPUT_TOKENS, OUTPUT_TOKENS = 1000, 50


def decide(text, tool_done, root):
    """What the agent does next: ("tool", path, content) or ("text", answer)."""
    action = ACTION.search(text)
    action = action.group(1) if action else None
    if action == "develop":
        task = TASK.search(text)
        task = task.group(1) if task else "task"
        if not tool_done:
            return ("tool", os.path.join(root, f"{task}.txt"), f"written by the agent for {task}\n")
        result = {"status": "success", "summary": f"wrote {task}.txt", "files_changed": [f"{task}.txt"]}
        return ("text", "Done.\n```json\n" + json.dumps(result) + "\n```")
    if action in RESULTS:
        return ("text", json.dumps(RESULTS[action]))
    return ("text", "OK")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "scripted-model/1"

    def log_message(self, *args):
        pass

    # -- plumbing -------------------------------------------------------------------------------

    def body(self):
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return {}

    def record(self, body, main):
        line = {"ts": time.time(), "path": self.path, "main": main, "stream": bool(body.get("stream"))}
        if self.server.args.bodies:
            line["body"] = body
        with self.server.log_lock, open(self.server.args.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def send_json(self, status, payload, headers=()):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def start_sse(self):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True

    def sse(self, data, event=None):
        chunk = (f"event: {event}\n" if event else "") + f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
        self.wfile.write(chunk.encode())
        self.wfile.flush()

    def fault(self, api):
        """Answers with the configured fault; returns whether it did."""
        fault = self.server.args.fault
        if fault == "none":
            return False
        with self.server.log_lock:
            if self.server.first_main is None:
                self.server.first_main = time.monotonic()
            elapsed = time.monotonic() - self.server.first_main
        if self.server.args.fault_for is not None and elapsed > self.server.args.fault_for:
            return False
        if fault == "hang":
            # Hold the connection open without a byte, until the client goes away.
            while not self.server.stopping.wait(0.5):
                pass
            return True
        status = {"401": 401, "429": 429, "529": 529, "500": 500}[fault]
        message = {
            401: "invalid x-api-key",
            429: "This request would exceed your rate limit",
            529: "Overloaded",
            500: "Internal server error",
        }[status]
        if api == "anthropic":
            kind = {401: "authentication_error", 429: "rate_limit_error", 529: "overloaded_error", 500: "api_error"}
            payload = {"type": "error", "error": {"type": kind[status], "message": message}}
        elif api == "gemini":
            state = {401: "UNAUTHENTICATED", 429: "RESOURCE_EXHAUSTED", 529: "UNAVAILABLE", 500: "INTERNAL"}
            payload = {"error": {"code": status, "message": message, "status": state[status]}}
        else:
            kind = {401: "invalid_api_key", 429: "rate_limit_exceeded", 529: "server_overloaded", 500: "server_error"}
            payload = {"error": {"message": message, "type": kind[status], "code": kind[status]}}
        headers = [("retry-after", "1")] if status in (429, 529) else []
        self.send_json(status, payload, headers)
        return True

    # -- routes ---------------------------------------------------------------------------------

    def do_GET(self):
        # Model listings and health checks: an empty, successful answer.
        self.record({}, False)
        self.send_json(200, {"data": [], "models": []})

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):
        body = self.body()
        path = self.path.split("?")[0]
        if path.endswith("/messages/count_tokens"):
            self.record(body, False)
            return self.send_json(200, {"input_tokens": INPUT_TOKENS})
        if path.endswith("/messages"):
            return self.anthropic(body)
        if path.endswith("/chat/completions"):
            return self.chat(body)
        if path.endswith("/responses"):
            return self.openai_responses(body)
        if ":streamGenerateContent" in path or ":generateContent" in path:
            return self.gemini(body, stream=":streamGenerateContent" in path)
        if ":countTokens" in path:
            self.record(body, False)
            return self.send_json(200, {"totalTokens": INPUT_TOKENS})
        self.record(body, False)
        self.send_json(404, {"error": {"message": f"no route {path}"}})

    # -- Anthropic Messages ---------------------------------------------------------------------

    def anthropic(self, body):
        main = bool(body.get("tools"))
        self.record(body, main)
        if main and self.fault("anthropic"):
            return
        messages = body.get("messages") or []
        last = messages[-1] if messages else {}
        content = last.get("content")
        tool_done = isinstance(content, list) and any(c.get("type") == "tool_result" for c in content)
        step = decide(json.dumps(messages), tool_done, self.server.args.root) if main else ("text", "OK")
        usage = {"input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        if step[0] == "tool":
            block = {"type": "tool_use", "id": f"toolu_{int(time.time() * 1e6)}", "name": "Write",
                     "input": {"file_path": step[1], "content": step[2]}}
            stop = "tool_use"
        else:
            block = {"type": "text", "text": step[1]}
            stop = "end_turn"
        message = {"id": "msg_scripted", "type": "message", "role": "assistant", "model": body.get("model", "m"),
                   "stop_reason": None, "stop_sequence": None}
        if not body.get("stream"):
            return self.send_json(200, {**message, "content": [block], "stop_reason": stop, "usage": usage})
        self.start_sse()
        self.sse({"type": "message_start", "message": {**message, "content": [],
                  "usage": {**usage, "output_tokens": 1}}}, "message_start")
        if block["type"] == "tool_use":
            self.sse({"type": "content_block_start", "index": 0,
                      "content_block": {**block, "input": {}}}, "content_block_start")
            self.sse({"type": "content_block_delta", "index": 0,
                      "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                     "content_block_delta")
        else:
            self.sse({"type": "content_block_start", "index": 0,
                      "content_block": {"type": "text", "text": ""}}, "content_block_start")
            self.sse({"type": "content_block_delta", "index": 0,
                      "delta": {"type": "text_delta", "text": block["text"]}}, "content_block_delta")
        self.sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
        self.sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                  "usage": {"output_tokens": OUTPUT_TOKENS}}, "message_delta")
        self.sse({"type": "message_stop"}, "message_stop")

    # -- OpenAI chat completions (Qwen Code) ----------------------------------------------------

    def chat(self, body):
        main = bool(body.get("tools"))
        self.record(body, main)
        if main and self.fault("chat"):
            return
        messages = body.get("messages") or []
        tool_done = bool(messages) and messages[-1].get("role") == "tool"
        step = decide(json.dumps(messages), tool_done, self.server.args.root) if main else ("text", "OK")
        usage = {"prompt_tokens": INPUT_TOKENS, "completion_tokens": OUTPUT_TOKENS,
                 "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS}
        if step[0] == "tool":
            name = tool_named(body.get("tools"), ("write_file", "WriteFile"), lambda t: t.get("function", {}).get("name"))
            call = {"index": 0, "id": f"call_{int(time.time() * 1e6)}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps({"file_path": step[1], "content": step[2]})}}
            delta, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        else:
            delta, finish = {"role": "assistant", "content": step[1]}, "stop"
        base = {"id": "chatcmpl-scripted", "created": int(time.time()), "model": body.get("model", "m")}
        if not body.get("stream"):
            message = {k: v for k, v in delta.items() if k != "tool_calls"}
            if "tool_calls" in delta:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in delta["tool_calls"]]
            return self.send_json(200, {**base, "object": "chat.completion", "usage": usage,
                                        "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        self.start_sse()
        chunk = {**base, "object": "chat.completion.chunk"}
        self.sse({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        self.sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        self.sse({**chunk, "choices": [], "usage": usage})
        self.sse("[DONE]")

    # -- OpenAI Responses (Codex) ---------------------------------------------------------------

    def openai_responses(self, body):
        main = bool(body.get("tools"))
        self.record(body, main)
        if main and self.fault("responses"):
            return
        items = body.get("input") or []
        tool_done = bool(items) and items[-1].get("type") in ("function_call_output", "custom_tool_call_output")
        step = decide(json.dumps(items), tool_done, self.server.args.root) if main else ("text", "OK")
        usage = {"input_tokens": INPUT_TOKENS, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": OUTPUT_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS}
        rid = f"resp_{int(time.time() * 1e6)}"
        if step[0] == "tool":
            # A shell command that writes the file: every Codex version has a shell tool.
            name = tool_named(body.get("tools"), ("shell", "exec_command", "local_shell"), lambda t: t.get("name"))
            script = f"printf '%s' {shell_quote(step[2])} > {shell_quote(step[1])}"
            args = {"command": ["bash", "-lc", script]} if name == "shell" else {"cmd": script}
            item = {"type": "function_call", "id": f"fc_{rid}", "call_id": f"call_{rid}", "name": name,
                    "arguments": json.dumps(args), "status": "completed"}
        else:
            item = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": step[1], "annotations": []}]}
        response = {"id": rid, "object": "response", "created_at": int(time.time()), "model": body.get("model", "m"),
                    "status": "in_progress", "output": []}
        self.start_sse()
        self.sse({"type": "response.created", "response": response}, "response.created")
        self.sse({"type": "response.output_item.added", "output_index": 0, "item": {**item, "status": "in_progress"}},
                 "response.output_item.added")
        if item["type"] == "message":
            self.sse({"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                      "content_index": 0, "delta": step[1]}, "response.output_text.delta")
        self.sse({"type": "response.output_item.done", "output_index": 0, "item": item}, "response.output_item.done")
        self.sse({"type": "response.completed",
                  "response": {**response, "status": "completed", "output": [item], "usage": usage}},
                 "response.completed")

    # -- Gemini ---------------------------------------------------------------------------------

    def gemini(self, body, stream):
        main = bool(body.get("tools"))
        self.record(body, main)
        if main and self.fault("gemini"):
            return
        contents = body.get("contents") or []
        last = contents[-1] if contents else {}
        tool_done = any("functionResponse" in p for p in last.get("parts", []))
        schema = (body.get("generationConfig") or {}).get("responseJsonSchema")
        if main:
            step = decide(json.dumps(contents), tool_done, self.server.args.root)
        elif schema:
            # A side request that wants JSON (Gemini CLI's model router): a minimal valid answer.
            step = ("text", json.dumps(sample(schema)))
        else:
            step = ("text", "OK")
        if step[0] == "tool":
            declarations = [d for t in body.get("tools") or [] for d in t.get("functionDeclarations", [])]
            name = tool_named([{"name": d.get("name")} for d in declarations], ("write_file",), lambda t: t.get("name"))
            part = {"functionCall": {"name": name, "args": {"file_path": step[1], "content": step[2]}}}
        else:
            part = {"text": step[1]}
        answer = {"candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}],
                  "usageMetadata": {"promptTokenCount": INPUT_TOKENS, "candidatesTokenCount": OUTPUT_TOKENS,
                                    "totalTokenCount": INPUT_TOKENS + OUTPUT_TOKENS},
                  "modelVersion": "scripted"}
        if not stream:
            return self.send_json(200, answer)
        self.start_sse()
        self.sse(answer)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that gave up mid-answer (a CLI being stopped) is expected; anything else not.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def tool_named(tools, wanted, name_of):
    """The first of `wanted` that the request offers (else the first wanted name)."""
    offered = [name_of(t) for t in tools or []]
    return next((w for w in wanted if w in offered), wanted[0])


def sample(schema):
    """The smallest value that fits a (Gemini-style) JSON schema."""
    kind = str(schema.get("type", "OBJECT")).upper()
    if kind == "OBJECT":
        props = schema.get("properties") or {}
        return {k: sample(props.get(k, {})) for k in schema.get("required", list(props))}
    return {"STRING": "ok", "INTEGER": 1, "NUMBER": 1, "BOOLEAN": False, "ARRAY": []}.get(kind)


def shell_quote(text):
    return "'" + text.replace("'", "'\\''") + "'"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="the project the agent works in")
    parser.add_argument("--log", required=True, help="where requests are logged, a JSON line each")
    parser.add_argument("--fault-for", type=float, metavar="SECONDS", help="fault only this long")
    parser.add_argument("--bodies", action="store_true", help="log each request's body too")
    parser.add_argument("--fault", default="none", choices=["none", "401", "429", "529", "500", "hang"])
    args = parser.parse_args()
    server = Server(("127.0.0.1", 0), Handler)
    server.args = args
    server.log_lock = threading.Lock()
    server.stopping = threading.Event()
    server.first_main = None
    print(server.server_address[1], flush=True)
    try:
        server.serve_forever()
    finally:
        server.stopping.set()


if __name__ == "__main__":
    sys.exit(main())
