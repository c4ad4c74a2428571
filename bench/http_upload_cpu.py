"""Large request bodies through the server's HTTP layer alone (uvicorn + FastAPI, no engine, no media
work), on this machine's CPU: when the server sees each request's headers, and when its JSON body is
parsed, for `--requests` bodies of `--mb` MB sent at once by one httpx client (the served video bench's
client: 24 requests of 5.2 MB). Two clients: one that JSON-encodes each body as its request starts (httpx's
`json=`), one that sends bodies encoded beforehand.

    python bench/http_upload_cpu.py [--requests 24] [--mb 5.2] [--http auto|h11|httptools] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = r"""
import sys, time
from typing import Annotated, Any
from fastapi import Body, FastAPI, Request
import uvicorn

app = FastAPI()

class Stamp:
    def __init__(self, app):
        self.app = app
    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["stamp"] = time.monotonic()
        await self.app(scope, receive, send)

app.add_middleware(Stamp)

@app.post("/x")
async def x(payload: Annotated[Any, Body()], request: Request):
    return {"headers": request.scope["stamp"], "parsed": time.monotonic()}

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http=sys.argv[2], log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def burst(url: str, n: int, body: dict, encoded: bool) -> dict[str, float]:
    """n requests at once; seconds from the start until the server saw their headers / parsed their body."""
    import httpx

    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}

    async def one(client: httpx.AsyncClient, t0: float) -> tuple[float, float, float]:
        if encoded:
            r = await client.post(url, content=data, headers=headers)
        else:
            r = await client.post(url, json=body)
        d = r.json()  # the server's clock is time.monotonic() on this host, as ours
        return d["headers"] - t0, d["parsed"] - t0, time.monotonic() - t0

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 4)) as client:
        await one(client, time.monotonic())  # a warm connection and route
        t0 = time.monotonic()
        res = await asyncio.gather(*(one(client, t0) for _ in range(n)))
    heads, parsed, done = zip(*res, strict=True)
    return {
        "headers_first_s": min(heads), "headers_mean_s": sum(heads) / n, "headers_last_s": max(heads),
        "parsed_first_s": min(parsed), "parsed_mean_s": sum(parsed) / n, "parsed_last_s": max(parsed),
        "responses_last_s": max(done),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--mb", type=float, default=5.2)
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), args.http])
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {
        "url": "data:video/jpeg;base64," + "A" * int(args.mb * 1e6)}}]}]}  # fmt: skip
    url = f"http://127.0.0.1:{port}/x"
    try:
        import httpx

        for _ in range(100):
            try:
                httpx.post(url, json={}, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        rows = {name: asyncio.run(burst(url, args.requests, body, encoded)) for name, encoded in
                (("encoded as sent", False), ("encoded before", True))}  # fmt: skip
    finally:
        server.terminate()
        server.wait()
    print(f"{args.requests} requests of {args.mb} MB at once, http={args.http}, {os.cpu_count()} CPUs (seconds)")
    print("| client | headers first / mean / last | body parsed first / mean / last | last response |")
    print("| --- | --- | --- | --- |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['headers_first_s']:.2f} / {r['headers_mean_s']:.2f} / {r['headers_last_s']:.2f} "
            f"| {r['parsed_first_s']:.2f} / {r['parsed_mean_s']:.2f} / {r['parsed_last_s']:.2f} "
            f"| {r['responses_last_s']:.2f} |"
        )
    if args.out is not None:
        result = {"requests": args.requests, "mb": args.mb, "http": args.http, "cpus": os.cpu_count(), "rows": rows}
        args.out.write_text(json.dumps(result | {"date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
