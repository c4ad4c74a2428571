"""vLLM 0.20.2 beside hylora on the users' video workload through their OpenAI servers (issue 29): the
checkpoint, adapters, videos and arrival patterns of `video_peer.py`, each video sent as a client sends
it to `vllm serve` / `hylora serve`.

- Requests: its 20 sampled frames as JPEGs in one `data:video/jpeg;base64,<frame>,...` URL (Qwen's
  client-side sampling; neither server needs a video decoder), the question, the adapter as `model`;
  streamed, greedy, 128 tokens with `ignore_eos`, usage in the last chunk. The JPEGs and the JSON bodies
  are encoded before the clock (the client's work); one request per (video, adapter), sent at its arrival
  time.
- Servers, one at a time on the GPU (started, warmed up, measured, stopped), each with its defaults
  (vLLM: torch.compile, CUDA graphs, its processor cache; hylora: CUDA graphs, its media and encoder
  caches) and the same settings: max_num_seqs 24, max_num_batched_tokens 8192, max model length
  10240, prefix caching off, the three adapters, one video per prompt, `--media-io-kwargs
  '{"video": {"fps": 2}}'` (the frames' rate, for their timestamps).
- Times from each request's arrival on the client: TTFT (the first chunk with a token), E2E (the last
  chunk), TPOT; from /metrics the servers' cache counters, their own latency means and hylora's intake
  phases and engine-thread seconds; with $PYSPY, py-spy recordings of the hylora server.

Phases: ckpt (video_peer's checkpoint, shared with it), vllm / hylora, table, run (as video_peer.py).

    bash bench/peer/video_server_gpu.sh       # H200, .vllm and .peerwhl carried: run ckpt vllm hylora
    python bench/peer/video_server_peer.py run ckpt hylora --tiny --device cpu --out /tmp/vsp   # CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peer import doctor_peer as dp  # noqa: E402
from bench.peer import engine_phases as ep  # noqa: E402
from bench.peer import throughput_peer as tp  # noqa: E402
from bench.peer import video_peer as vp  # noqa: E402
from bench.peer.child_env import child_env  # noqa: E402

PREFIX = "video_server"  # results: WORK/results/video_server-<engine>.json (bf16), video_server_fp8-<engine>.json
MIN_LEFT_S = {"ckpt": 60, "vllm": 330, "hylora": 200}
READY_S = 480  # the most a server may take to start
# /metrics samples kept per pattern (names containing one of these)
COUNTERS = (
    "mm_cache", "media_cache", "encoder_cache", "preemptions", "engine_steps", "steps_ahead", "engine_step_seconds",
    "engine_add_seconds",
)  # fmt: skip
# the servers' own request latencies (vLLM's histograms, which hylora serves too): their _sum and _count are
# kept per pattern, for the means on each server's clock (hylora's starts at a request's headers, vLLM's
# when it starts rendering the request: its body parsed, its media not yet fetched)
SERVER_LATENCIES = {
    "TTFT": "vllm:time_to_first_token_seconds",
    "E2E": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
INTAKE = "hylora_request_intake_seconds"  # hylora's, by phase (hylora/server/timing.py): kept as <name>:<phase>
INTAKE_PHASES = ("read", "prepare", "admit")
PYSPY = os.environ.get("PYSPY")  # a py-spy binary: the hylora server is sampled during each pattern


def log(*parts: object) -> None:
    tp.log(*parts)


def frame_urls(videos: vp.Videos) -> dict[int, str]:
    """Each video's frames as one data:video/jpeg;base64 URL."""
    from PIL import Image

    urls = {}
    for v, frames in videos.frames.items():
        parts = []
        for frame in frames:
            buf = io.BytesIO()
            Image.fromarray(frame).save(buf, format="JPEG", quality=90)
            parts.append(base64.b64encode(buf.getvalue()).decode())
        urls[v] = "data:video/jpeg;base64," + ",".join(parts)
    return urls


def server_args(engine: str, args: argparse.Namespace, videos: vp.Videos) -> list[str]:
    """The launch line both servers share (vLLM's flag names; hylora takes them), then each one's own."""
    work, cpu = args.work, args.device == "cpu"
    adapters = [f"{a}={vp.adapters_dir(work) / a}" for a in vp.ADAPTERS]
    shared = [
        str(vp.ckpt_dir(work, args.weights)), "--served-model-name", "base", "--host", "127.0.0.1",
        "--dtype", "float32" if cpu else "bfloat16", "--max-model-len", str(vp.MAX_MODEL_LEN),
        "--max-num-seqs", str(vp.MAX_NUM_SEQS), "--max-num-batched-tokens", str(vp.MNBT), "--seed", "0",
        "--no-enable-prefix-caching", "--max-loras", str(len(vp.ADAPTERS)), "--max-lora-rank", str(vp.RANK),
        "--lora-modules", *adapters, "--limit-mm-per-prompt", json.dumps({"image": 0, "video": 1}),
        "--media-io-kwargs", json.dumps({"video": {"fps": videos.fps}}), "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if engine == "vllm":
        own = ["--enable-lora", "--gdn-prefill-backend", "triton"]
        own += ["--gpu-memory-utilization", str(tp.GPU_MEMORY_UTILIZATION)]
        own += ["--attention-backend", args.attention_backend] if args.attention_backend else []
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *shared, *own]
    own = ["--device", args.device]  # its request log on (one line each, with its intake's phases), as by default
    own += [] if args.encode_media_ahead else ["--no-encode-media-ahead"]
    own += ["--kernels", tp.kernel_switches(args.kernels)] if args.kernels else []
    own += shlex.split(os.environ.get("HYLORA_SERVE_ARGS", ""))  # more of hylora's flags, e.g. to compare two
    return [sys.executable, "-m", "hylora", "serve", *shared, *own]


# --------------------------------------------------------------------------------------------
# the client


def request_body(job: vp.Job, video_url: str, max_tokens: int) -> bytes:
    """The request's JSON, encoded before the clock as its JPEGs are (the client's work: 24 bodies of 5.2 MB
    encoded as the requests start held the client's event loop ~0.5 s before any was sent)."""
    body = {
        "model": job.adapter,
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": video_url}},
            {"type": "text", "text": f"{vp.QUESTION} (clip {job.video})"},
        ]}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,  # a token whose text is not yet whole still shows (random weights: most)
    }  # fmt: skip
    return json.dumps(body).encode()


async def send(client: Any, url: str, job: vp.Job, body: bytes, t0: float) -> dict[str, Any]:
    """One streamed request at its arrival time; its times from that arrival."""
    import httpx

    await asyncio.sleep(max(0.0, job.arrival - (time.monotonic() - t0)))
    arrived = t0 + job.arrival
    first = None
    usage: dict[str, Any] = {}
    error = None
    try:
        headers = {"Content-Type": "application/json"}
        async with client.stream("POST", f"{url}/v1/chat/completions", content=body, headers=headers) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = str(chunk["error"])[:300]
                    if first is None and any(
                        c.get("token_ids") or (c.get("delta") or {}).get("content") for c in chunk.get("choices", [])
                    ):
                        first = time.monotonic()
                    usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"[:300]
    end = time.monotonic()
    n = int(usage.get("completion_tokens") or 0)
    ttft = None if first is None else first - arrived
    return {
        "request": job.request_id, "video": job.video, "adapter": job.adapter, "arrival_s": job.arrival,
        "ttft_s": ttft, "e2e_s": end - arrived,
        "tpot_s": None if ttft is None or n < 2 else (end - first) / (n - 1),
        "prompt_tokens": usage.get("prompt_tokens"), "output_tokens": n, "error": error, "add_s": None,
    }  # fmt: skip


async def drive(url: str, jobs: list[vp.Job], urls: dict[int, str], max_tokens: int) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(jobs) + 4)
    tokens = {j.request_id: 4 if j.request_id.startswith("warm") else max_tokens for j in jobs}
    bodies = {j.request_id: request_body(j, urls[j.video], tokens[j.request_id]) for j in jobs}
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.monotonic()
        records = await asyncio.gather(*(send(client, url, j, bodies[j.request_id], t0) for j in jobs))
    return list(records), max(r["arrival_s"] + r["e2e_s"] for r in records)


def counters(url: str) -> dict[str, float]:
    """The servers' cache, preemption and step counters and their latency histograms' _sum and _count on
    /metrics, summed by name."""
    import httpx

    latencies = {f"{h}{end}" for h in SERVER_LATENCIES.values() for end in ("_sum", "_count")}
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or "_created" in line:
            continue
        name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[-1]
        if name in (f"{INTAKE}_sum", f"{INTAKE}_count") and 'phase="' in line:
            name += ":" + line.split('phase="')[1].split('"')[0]
        elif not (name in latencies or any(c in name for c in COUNTERS)):
            continue
        found[name] = found.get(name, 0.0) + float(value)
    return found


def server_means(counts: dict[str, float]) -> dict[str, float]:
    """Each server latency's mean over a pattern's requests, from its /metrics _sum and _count deltas."""
    means = {}
    names = {label: (f"{h}_sum", f"{h}_count") for label, h in SERVER_LATENCIES.items()}
    names |= {f"intake {p}": (f"{INTAKE}_sum:{p}", f"{INTAKE}_count:{p}") for p in INTAKE_PHASES}
    for label, (total, count) in names.items():
        n = counts.get(count, 0.0)
        if n > 0:
            means[label] = counts.get(total, 0.0) / n
    return means


# --------------------------------------------------------------------------------------------
# phases vllm / hylora


def phase_engine(engine: str, args: argparse.Namespace) -> None:
    import importlib.util

    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM is not importable here (bench/peer/video_server_gpu.sh installs the carried one)")
    work, prefix = args.work, vp.result_prefix(PREFIX, args.weights)
    vp.require_ckpt(args)
    packages = ("vllm", "torch", "transformers") if engine == "vllm" else ("torch", "triton", "transformers")
    data = vp.new_result(engine, packages, args)
    videos = vp.make_videos(args.tiny, args.rate, full_warm_up=args.full_warm_up)
    urls = frame_urls(videos)
    cmd = server_args(engine, args, videos)
    port = dp.free_port()
    server = dp.Server(engine, [*cmd, "--port", str(port)], port, work / "logs" / f"video-server-{engine}.log")
    data["settings"] = {"command": " ".join(cmd[2:]).replace(str(work), "WORK")}
    ep.save(work, prefix, data)
    server.start(child_env())
    try:
        why = server.wait_ready(time.monotonic() + READY_S)
        if why is not None:
            raise RuntimeError(f"{engine} server {why}")
        data.update(startup_s=server.ready_s, card=tp.card(args.device))
        t0 = time.perf_counter()
        asyncio.run(drive(server.url, videos.jobs["warm"], urls, videos.max_tokens))
        data["warm_up_s"] = time.perf_counter() - t0
        for pattern in args.patterns:
            before = counters(server.url)
            samplers = sample(server, args.out / "pyspy" / f"{engine}-{pattern}") if engine == "hylora" else []
            try:
                records, wall = asyncio.run(drive(server.url, videos.jobs[pattern], urls, videos.max_tokens))
            finally:
                stop_sampling(samplers)
            after = counters(server.url)
            row = vp.summary(pattern, records, wall, counters={k: v - before.get(k, 0.0) for k, v in after.items()})
            row["server_means"] = server_means(row["counters"])
            data["runs"].append(row)
            e2e = row["e2e_s"]
            log(f"{engine} server {pattern}: {row['out_tok_s']:.0f} out tok/s, E2E p50 {e2e.get('p50', 0):.2f}s "
                f"p99 {e2e.get('p99', 0):.2f}s, {row['failed']} failed {row['errors'][:2]}; on the server's clock "
                + ", ".join(f"{k} {v:.2f}s" for k, v in row["server_means"].items()))  # fmt: skip
            ep.save(work, prefix, data)
        data["complete"] = True
    except BaseException as e:
        data["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        ep.save(work, prefix, data)
        server.stop()
        args.out.mkdir(parents=True, exist_ok=True)
        if server.log_path.is_file():
            (args.out / server.log_path.name).write_bytes(server.log_path.read_bytes()[-200_000:])


def sample(server: dp.Server, prefix: Path) -> list[subprocess.Popen]:
    """With $PYSPY set: two py-spy recorders on the server's process, one of the thread that holds the GIL
    (`<prefix>-gil.txt`), one of every thread, idle ones too (`<prefix>-all.txt`), as collapsed stacks with
    thread ids (bench/peer/pyspy_top.py reads them). None when py-spy is not given or cannot start."""
    if not PYSPY or server.proc is None:
        return []
    prefix.parent.mkdir(parents=True, exist_ok=True)
    recorders = []
    for name, flag in (("gil", "--gil"), ("all", "--idle")):
        cmd = [PYSPY, "record", "--pid", str(server.proc.pid), "--rate", "200", "--format", "raw", "--threads",
               "--nonblocking", flag, "-o", f"{prefix}-{name}.txt"]  # fmt: skip
        log_file = open(f"{prefix}-{name}.log", "wb")  # noqa: SIM115 - the recorder's until it stops
        try:
            recorders.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT))
        except OSError as e:
            log(f"py-spy did not start: {e}")
        finally:
            log_file.close()
    time.sleep(1.0)  # attached before the first request
    return recorders


def stop_sampling(recorders: list[subprocess.Popen]) -> None:
    for r in recorders:
        if r.poll() is None:
            r.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for r in recorders:
        try:
            r.wait(timeout=60)
        except subprocess.TimeoutExpired:
            r.kill()
        if r.returncode:
            log(f"py-spy exited with {r.returncode} ({' '.join(r.args[-3:])})")


# --------------------------------------------------------------------------------------------
# phases table / run


def table_md(found: dict[str, dict[str, Any]]) -> str:
    """video_peer's table, then each pattern's means on the client's clock beside the server's own: the
    difference is the time before the server's clock starts (hylora: the request's upload, parsing and
    media preprocessing)."""
    lines = [
        vp.table_md(found, through="their OpenAI servers (frames as data:video/jpeg, streamed)").rstrip("\n"),
        "",
        "Means over each pattern's requests (s): the client's clock (from the request's arrival) beside each "
        "server's own (its /metrics histograms; hylora's clock starts at the request's headers, vLLM's when it "
        "starts rendering the request: after its body was parsed, before its media are fetched); hylora's "
        "intake by phase (read: the body received and parsed; prepare: prompt and media; admit: the engine "
        "thread took it); hylora's engine thread: seconds in steps and admissions against the pattern's wall, "
        "and its steps.",
        "",
        "| arrivals | engine | client TTFT / E2E | server TTFT / E2E | server queue / prefill "
        "| intake read / prepare / admit | engine thread busy | steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(a: float | None, b: float | None) -> str:
        return f"{a:.2f} / {b:.2f}" if a is not None and b is not None else "–"

    for p in vp.PATTERNS:
        for engine, d in (("vLLM", found.get("vllm")), ("hylora", found.get("hylora"))):
            r = vp.run_of(d, p)
            if r is None:
                continue
            m = r.get("server_means") or {}
            client = cell(r["ttft_s"].get("mean"), r["e2e_s"].get("mean"))
            intake = [m.get(f"intake {phase}") for phase in INTAKE_PHASES]
            c = r.get("counters") or {}
            busy = c.get("hylora_engine_step_seconds", 0.0) + c.get("hylora_engine_add_seconds", 0.0)
            steps = c.get("hylora_engine_steps")
            wall = r["wall_s"]
            lines.append(
                f"| {p} | {engine} | {client} | {cell(m.get('TTFT'), m.get('E2E'))} "
                f"| {cell(m.get('queue'), m.get('prefill'))} "
                f"| {' / '.join(f'{v:.2f}' for v in intake) if None not in intake else '–'} "
                f"| {f'{busy:.1f} s of {wall:.1f}' if busy else '–'} | {f'{steps:.0f}' if steps else '–'} |"
            )
    return "\n".join(lines) + "\n"


def phase_table(args: argparse.Namespace) -> None:
    prefix = vp.result_prefix(PREFIX, args.weights)
    ep.phase_table(args, prefix, table_md, f"{prefix}_peer.md")


def phase_run(args: argparse.Namespace) -> None:
    ep.phase_run(args, Path(__file__).resolve(), MIN_LEFT_S, vp.child_flags(args))
    phase_table(args)


PHASES = {
    "ckpt": vp.phase_ckpt,
    "vllm": lambda args: phase_engine("vllm", args),
    "hylora": lambda args: phase_engine("hylora", args),
    "table": phase_table,
    "run": phase_run,
}


def main() -> None:
    tp.run_phase(PHASES, ep.parse_args(__doc__, list(PHASES), "/tmp/videoserverpeer_out", vp.add_args, None))


if __name__ == "__main__":
    main()
