#!/usr/bin/env python3
"""A scripted Anthropic model on 127.0.0.1 for Claude Code driving loopd through its MCP server
(tests/mcp.rs): the person's agent that makes a loop, waits for it and reads its diff.

Each turn of the main conversation (a request that offers loopd's tools) answers by how many of
loopd's tool results the conversation holds: none, call create_loop; one, check it made a loop and
call wait_for_loop; two, check the loop completed and call loop_diff; three, check the diff holds
both tasks' lines and end the turn with "DONE". What each check found is appended to --log, one
JSON line each ({"check": NAME, "ok": BOOL, "seen": ...}); other requests get a plain answer. The
first line on stdout is the port.
"""

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CREATE, WAIT, DIFF = "mcp__loopd__create_loop", "mcp__loopd__wait_for_loop", "mcp__loopd__loop_diff"
USAGE = {"input_tokens": 100, "output_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def text_of(result):
    content = result.get("content")
    if isinstance(content, str):
        return content
    return "".join(c.get("text", "") for c in content or [] if isinstance(c, dict))


def parsed(text):
    try:
        return json.loads(text)
    except ValueError:
        return {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def check(self, name, ok, seen):
        with self.server.lock, open(self.server.log, "a") as f:
            f.write(json.dumps({"check": name, "ok": bool(ok), "seen": seen}) + "\n")

    def send_json(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.send_json({"data": []})

    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        if self.path.split("?")[0].endswith("/count_tokens"):
            return self.send_json({"input_tokens": 100})
        offered = [t.get("name") for t in body.get("tools") or []]
        block = self.turn(body.get("messages") or []) if CREATE in offered else {"type": "text", "text": "OK"}
        self.answer(body, block)

    def turn(self, messages):
        results = [
            c
            for m in messages
            if m.get("role") == "user" and isinstance(m.get("content"), list)
            for c in m["content"]
            if isinstance(c, dict) and c.get("type") == "tool_result"
        ]
        said = [parsed(text_of(r)) for r in results]
        if not results:
            return self.tool(CREATE, {"title": "write two files"})
        id = said[0].get("loop_id")
        if len(results) == 1:
            self.check("created", id and said[0].get("started"), said[0])
            return self.tool(WAIT, {"id": id, "timeout_seconds": 120})
        if len(results) == 2:
            self.check("waited", said[1].get("status") == "completed", said[1])
            return self.tool(DIFF, {"id": id})
        diff = said[2].get("diff", "")
        self.check("diff", "+task-001" in diff and "+task-002" in diff, diff)
        return {"type": "text", "text": f"DONE: loop {id} wrote both files."}

    def tool(self, name, arguments):
        return {"type": "tool_use", "id": f"toolu_{int(time.time() * 1e6)}", "name": name, "input": arguments}

    def answer(self, body, block):
        stop = "tool_use" if block["type"] == "tool_use" else "end_turn"
        message = {"id": "msg_scripted", "type": "message", "role": "assistant", "model": body.get("model", "m"),
                   "stop_sequence": None}
        if not body.get("stream"):
            return self.send_json({**message, "content": [block], "stop_reason": stop, "usage": USAGE})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True

        def sse(event, data):
            self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        sse("message_start", {"type": "message_start",
                              "message": {**message, "content": [], "stop_reason": None, "usage": USAGE}})
        if block["type"] == "tool_use":
            sse("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {**block, "input": {}}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            sse("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}})
            delta = {"type": "text_delta", "text": block["text"]}
        sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                              "usage": {"output_tokens": 10}})
        sse("message_stop", {"type": "message_stop"})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", required=True, help="where the checks are logged, a JSON line each")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.log = args.log
    server.lock = threading.Lock()
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
