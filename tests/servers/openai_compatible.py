"""A small OpenAI-compatible chat-completions server for the tests (tests/test_pairwise.py): it serves one causal LM
through transformers, greedy, one request at a time, the messages rendered with the model's own chat template and
its generation prompt, as an inference server does. Test fixture only: it binds 127.0.0.1, answers at most
--max-requests completions, and stops by itself after --idle-timeout seconds without a request.

    python tests/servers/openai_compatible.py --model DIR --port-file F [--require-key-env VAR] [--delay S]
    python tests/servers/openai_compatible.py --rule longer --port-file F

`--rule longer` serves no model: it answers as a judge with a known rule, for tests of what is done with the
verdicts. The judging prompt must mark the responses <<A>>...<</A>> and <<B>>...<</B>> (tests/servers/marked_judge.txt);
the answer is A when A's response is longer (in characters), B when B's is, tie when they are equally long.

GET /v1/models lists the model; POST /v1/chat/completions answers; GET /stats returns {"completions": n}. With
--require-key-env, a request without `Authorization: Bearer <that variable's value>` gets 401."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--rule", choices=["longer"])
    p.add_argument("--name", default="judge")
    p.add_argument("--port-file", required=True)
    p.add_argument("--require-key-env")
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--idle-timeout", type=float, default=120)
    p.add_argument("--delay", type=float, default=0.0, help="seconds added to every completion")
    args = p.parse_args()

    if args.rule is None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    def rule_answer(text: str) -> str:
        a = text.split("<<A>>", 1)[1].split("<</A>>", 1)[0]
        b = text.split("<<B>>", 1)[1].split("<</B>>", 1)[0]
        return "A" if len(a) > len(b) else "B" if len(b) > len(a) else "tie"
    key = os.environ.get(args.require_key_env, "") if args.require_key_env else None
    state = {"completions": 0, "last": time.time()}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            return key is None or self.headers.get("Authorization") == f"Bearer {key}"

        def do_GET(self):
            state["last"] = time.time()
            if self.path.rstrip("/") == "/stats":
                return self._send(200, {"completions": state["completions"]})
            if not self._authorised():
                return self._send(401, {"error": "unauthorised"})
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": args.name, "object": "model"}]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            state["last"] = time.time()
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            if not self._authorised():
                return self._send(401, {"error": "unauthorised"})
            if state["completions"] >= args.max_requests:
                return self._send(429, {"error": "request budget of this test server spent"})
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if args.rule:
                answer = rule_answer(req["messages"][-1]["content"])
            else:
                text = tok.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
                enc = tok(text, return_tensors="pt", add_special_tokens=False)
                with torch.no_grad():
                    out = model.generate(**enc, do_sample=False, max_new_tokens=int(req.get("max_tokens", 16)),
                                         pad_token_id=tok.pad_token_id)
                answer = tok.decode(out[0, enc["input_ids"].size(1):], skip_special_tokens=True)
            time.sleep(args.delay)
            state["completions"] += 1
            self._send(200, {"object": "chat.completion", "model": req.get("model"),
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                          "finish_reason": "stop"}]})

    server = HTTPServer(("127.0.0.1", 0), Handler)

    def watchdog():
        while True:
            time.sleep(1)
            if time.time() - state["last"] > args.idle_timeout:
                server.shutdown()
                return

    threading.Thread(target=watchdog, daemon=True).start()
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
