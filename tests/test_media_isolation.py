"""A hostile image or video fails its own request, promptly, within its memory, and nobody else's (issue 22).

CPU only, against tests/media_helpers.py's hostile local HTTP server and hand-written bombs:
- fetches: one deadline covers connect, headers and body; a request's failure or cancellation cancels its
  other fetches (the server sees the connections close); at most 4 fetches per request at once;
- Content-Encoding: one coding at most, decoded in bounded slices;
- decoding: the pixels × frames budget refuses the 8000² × 500-frame GIF from its header, a cancelled request's
  decode stops at its next frame, containers such as ICO are not opened;
- memory (measured in a subprocess): the bombs raise the peak RSS by less than 2 × max_bytes;
- isolation: while those run, the event loop's heartbeat and a text-only tokenising call on its own executor
  are not delayed by more than 1 s, and media work never touches the loop's default executor;
- honest errors: file:// answers the same for missing and outside the root; NUL bytes, malformed redirects → 400.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hylora.config import ModelConfig
from hylora.engine.chat_input import MediaSettings, multimodal_prompt
from hylora.media import (
    FetchPolicy,
    MediaError,
    MediaLimits,
    MediaPools,
    fetch_bytes,
    fetch_url,
    process_image,
    process_video,
)
from hylora.media.budget import CancelFlag, Cancelled, DecodeBudget
from hylora.media.config import MediaConfig
from hylora.tokenizer import chat_prompt, load_tokenizer
from tests.media_helpers import HostileServer, hostile_gif, ico_wrapping, image_bytes, png_header_bomb, video_bytes

LOCAL = FetchPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=1.0)
ROOT = Path(__file__).resolve().parents[1]


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def ask(*parts: tuple[str, str]) -> list[dict]:
    content = [{"type": kind, kind: {"url": url}} for kind, url in parts]
    return [{"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]}]


@pytest.fixture(scope="module")
def demo(demo_dir):
    return demo_dir, ModelConfig.from_dir(demo_dir).vision, load_tokenizer(demo_dir)


def settings(demo, policy: FetchPolicy = LOCAL, **kw) -> MediaSettings:
    model_dir, vision, tokenizer = demo
    return MediaSettings.for_model(model_dir, vision, tokenizer, policy=policy, **kw)


@pytest.fixture
def server():
    with HostileServer() as srv:
        yield srv


async def until(predicate, timeout: float = 2.0) -> float:
    """Seconds until `predicate()` holds (fails the test past `timeout`)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


# --- fetch deadlines and cancellation ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/silent", "/trickle-headers", "/trickle-body"])
def test_one_deadline_covers_connect_headers_and_body(server, path):
    server.routes[path].interval_s = 0.05  # a header line / body byte every 50 ms keeps httpx's read timeout happy
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out"):
        fetch_bytes(server.url(path), LOCAL, 1 << 20)
    assert 0.9 < time.monotonic() - start < 3.0  # timeout_s = 1.0; the routes trickle forever


def test_a_failed_item_cancels_the_requests_other_fetches(demo, server):
    failing = server.add("/late-404", status=404, delay_s=0.5)

    async def main():
        start = time.monotonic()
        with pytest.raises(MediaError, match="HTTP 404"):
            await multimodal_prompt(
                settings(demo, FetchPolicy(allowed_domains=LOCAL.allowed_domains, timeout_s=30)),
                demo[2],
                ask(*[("image_url", server.url("/silent"))] * 3, ("image_url", failing)),
            )
        failed_after = time.monotonic() - start
        assert server.connections == 4  # all four were in flight
        closed_after = await until(lambda: server.open_connections == 0, timeout=1.0)
        return failed_after, closed_after

    failed_after, closed_after = asyncio.run(main())
    assert failed_after < 1.5 and closed_after < 0.5


def test_at_most_four_fetches_of_one_request_at_once(demo, server):
    async def main():
        task = asyncio.create_task(
            multimodal_prompt(settings(demo), demo[2], ask(*[("image_url", server.url("/silent"))] * 8))
        )
        await asyncio.sleep(0.5)
        in_flight = server.open_connections
        with pytest.raises(MediaError, match="timed out"):
            await task
        await until(lambda: server.open_connections == 0, timeout=1.0)
        return in_flight

    assert asyncio.run(main()) == 4
    assert server.connections == 4  # the other four never started: the first timeout failed the request


def test_client_leaving_cancels_fetches_and_stops_the_decode_at_its_next_frame(demo, server, monkeypatch):
    pools = MediaPools(decode_threads=1)
    heavy = data_url(hostile_gif(2000, 2000, 2000), "image/gif")  # 8e9 pixels: in budget, seconds of decoding
    frames = [0]
    charge = DecodeBudget.charge

    def counted(self, width, height):
        charge(self, width, height)
        frames[0] += 1

    monkeypatch.setattr(DecodeBudget, "charge", counted)

    async def main():
        s = settings(demo, FetchPolicy(allowed_domains=LOCAL.allowed_domains, timeout_s=30), pools=pools)
        task = asyncio.create_task(
            multimodal_prompt(s, demo[2], ask(("image_url", server.url("/silent")), ("video_url", heavy)))
        )
        await until(lambda: frames[0] > 10, timeout=5.0)
        assert server.open_connections == 1
        start = time.monotonic()
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled_after = time.monotonic() - start
        closed_after = await until(lambda: server.open_connections == 0, timeout=1.0)
        start = time.monotonic()
        await pools.run(pools.decode, lambda: None)  # the one decode thread is free again
        freed_after, decoded = time.monotonic() - start, frames[0]
        await asyncio.sleep(0.3)
        return cancelled_after, closed_after, freed_after, decoded, frames[0]

    try:
        cancelled_after, closed_after, freed_after, decoded, later = asyncio.run(main())
    finally:
        pools.close()
    assert cancelled_after < 0.2 and closed_after < 0.5 and freed_after < 0.5
    assert decoded == later < 2000  # nothing decoded after the cancel came through


def test_an_image_does_not_wait_behind_videos_that_hold_every_decode_thread(demo, monkeypatch):
    """Two long video decodes (in budget: seconds each) hold both decode threads; an image request
    arriving then is prepared while they still run (it used to queue behind them)."""
    pools = MediaPools(decode_threads=2)
    # 8e9 pixels each; two different files (one file's concurrent requests share one decode)
    heavy = [data_url(hostile_gif(2000, 2000, 2000, delay_cs=d), "image/gif") for d in (10, 11)]
    decoding: set[int] = set()
    charge = DecodeBudget.charge

    def counted(self, width, height):
        decoding.add(id(self))
        charge(self, width, height)

    monkeypatch.setattr(DecodeBudget, "charge", counted)

    async def main():
        s = settings(demo, pools=pools)
        videos = [asyncio.create_task(multimodal_prompt(s, demo[2], ask(("video_url", v)))) for v in heavy]
        await until(lambda: len(decoding) == 2, timeout=10.0)
        image = data_url(image_bytes(64, 64), "image/png")
        ids, prompt = await multimodal_prompt(s, demo[2], ask(("image_url", image)))
        still_decoding = [not v.done() for v in videos]
        for v in videos:
            v.cancel()
        await asyncio.gather(*videos, return_exceptions=True)
        return prompt, still_decoding

    try:
        prompt, still_decoding = asyncio.run(main())
    finally:
        pools.close()
    assert len(prompt.items) == 1 and still_decoding == [True, True]


def test_cancel_flag_stops_a_running_decode():
    cancel = CancelFlag()
    cancel.set()
    with pytest.raises(Cancelled):
        process_video(hostile_gif(64, 64, 20), MediaConfig(), MediaLimits(), cancel=cancel)
    with pytest.raises(Cancelled):
        process_image(image_bytes(32, 32), MediaConfig(), MediaLimits(), cancel=cancel)


# --- Content-Encoding ---------------------------------------------------------------------------------------


def test_content_encoding_one_coding_at_most_decoded_in_bounded_slices(server):
    payload = image_bytes(64, 64)
    raw_deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    cases = {
        "gzip": gzip.compress(payload),
        "x-gzip": gzip.compress(payload),
        "deflate": zlib.compress(payload),
        "identity, gzip": gzip.compress(payload),
        "identity": payload,
    }
    for i, (coding, body) in enumerate(cases.items()):
        url = server.add(f"/ok{i}", body, headers={"Content-Encoding": coding})
        assert fetch_bytes(url, LOCAL, 1 << 20) == payload, coding
    url = server.add(
        "/raw-deflate", raw_deflate.compress(payload) + raw_deflate.flush(), headers={"Content-Encoding": "deflate"}
    )
    assert fetch_bytes(url, LOCAL, 1 << 20) == payload
    url = server.add(
        "/members", gzip.compress(payload[:100]) + gzip.compress(payload[100:]), headers={"Content-Encoding": "gzip"}
    )
    assert fetch_bytes(url, LOCAL, 1 << 20) == payload
    for path, match in [
        ("/gzip-gzip", "Content-Encoding 'gzip, gzip': the server decodes at most one coding"),
        ("/br", "Content-Encoding 'br', which the server does not decode"),
        ("/gzip-bomb", "larger than 8388608 bytes"),
    ]:
        start = time.monotonic()
        with pytest.raises(MediaError, match=match):
            fetch_bytes(server.url(path), LOCAL, 8 << 20)
        assert time.monotonic() - start < 3.0, path
    url = server.add("/corrupt", b"\x1f\x8b\x08\x00" + b"\xff" * 50, headers={"Content-Encoding": "gzip"})
    with pytest.raises(MediaError, match="gzip body is corrupt"):
        fetch_bytes(url, LOCAL, 1 << 20)


MEMORY_PROBE = """
import asyncio, ctypes, json, sys, time
sys.path.insert(0, {root!r})
from hylora.media import FetchPolicy, MediaConfig, MediaError, MediaLimits, fetch_url, process_image, process_video
from tests.media_helpers import hostile_gif, ico_wrapping, png_header_bomb

MAX, BASE = 16 << 20, {base!r}
limits, policy = MediaLimits(max_bytes=MAX), FetchPolicy(allowed_domains=frozenset({{"127.0.0.1"}}), timeout_s=5)
gif, ico = hostile_gif(8000, 8000, 500), ico_wrapping(png_header_bomb(12000))


def peak_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024


async def sync(fn, *args):
    return fn(*args)


async def main():  # one event loop, as in the server
    await fetch_url(BASE + "/warm", policy, MAX)  # imports, the client, its TLS context
    for data, fn in ((gif[:100], process_video), (ico[:100], process_image)):
        try:
            fn(data, MediaConfig(), limits)
        except MediaError:
            pass
    attacks = {{
        "control: a plain body of max_bytes": lambda: fetch_url(BASE + "/plain", policy, MAX),
        "gzip-gzip": lambda: fetch_url(BASE + "/gzip-gzip", policy, MAX),
        "gzip-bomb": lambda: fetch_url(BASE + "/gzip-bomb", policy, MAX),
        "gif-8000x8000x500": lambda: sync(process_video, gif, MediaConfig(), limits),
        "ico-12000x12000-png": lambda: sync(process_image, ico, MediaConfig(), limits),
    }}
    out = {{}}
    for name, attack in attacks.items():
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: what is measured is new
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS
        base, start = peak_mb(), time.monotonic()
        try:
            await attack()
            error = None
        except MediaError as e:
            error = str(e)
        out[name] = dict(mb=peak_mb() - base, s=time.monotonic() - start, error=error)
    return out


print(json.dumps(asyncio.run(main())))
"""


def memory_probe(server: HostileServer) -> dict[str, dict]:
    """The bombs against a fresh interpreter (the server stays in this process): peak RSS rise, seconds, error."""
    server.add("/warm", gzip.compress(b"x" * 100_000), headers={"Content-Encoding": "gzip"})
    server.add("/plain", b"x" * (16 << 20))
    probe = MEMORY_PROBE.format(root=str(ROOT), base=server.url(""))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bombs_raise_peak_rss_by_less_than_twice_max_bytes(server):
    results = memory_probe(server)
    control = results.pop("control: a plain body of max_bytes")
    assert control["error"] is None and control["mb"] > 12, control  # the probe sees a body being held
    for name, r in results.items():
        assert r["error"], (name, r)  # refused
        assert r["mb"] < 2 * 16, (name, r)  # max_bytes = 16 MB
        assert r["s"] < 2.0, (name, r)


# --- decoding -----------------------------------------------------------------------------------------------


def test_decode_budget_refuses_the_hostile_gif_from_its_header():
    start = time.monotonic()
    with pytest.raises(MediaError, match="500 frames of 8000x8000: 32000000000 pixels to decode"):
        process_video(hostile_gif(8000, 8000, 500), MediaConfig(), MediaLimits())
    assert time.monotonic() - start < 3.0  # decoding it: hours
    budget = DecodeBudget(MediaLimits().max_decode_pixels)
    budget.check_plan(18_000, 1280, 720)  # 10 minutes of 720p at 30 fps pass
    with pytest.raises(MediaError):
        budget.check_plan(18_000, 1920, 1080)  # 10 minutes of 1080p do not (4.4 minutes do)


def test_decode_budget_counts_packets_without_a_frame_count_and_charges_every_frame():
    from hylora.media import video

    webm = video_bytes(12, 64, 48, fps=6, fmt="webm", codec="libvpx")  # its header says 0 frames
    with pytest.raises(MediaError, match="12 frames of 64x48"):  # counted from packets, before decoding
        process_video(webm, MediaConfig(), MediaLimits(max_decode_pixels=64 * 48 * 11))
    with pytest.raises(MediaError, match="needs more than 30000 decoded pixels"):  # enforced while decoding
        video._count_frames(webm, MediaLimits(), DecodeBudget(30_000))
    assert process_video(webm, MediaConfig(), MediaLimits(max_decode_pixels=64 * 48 * 12)).grid_thw[0] >= 2


def test_images_refused_by_format_and_header_before_decoding():
    cases = [
        (ico_wrapping(png_header_bomb(12000)), "not a supported format"),  # the ICO says 256x256
        (png_header_bomb(10000), "10000x10000 = 100000000 pixels; the server accepts at most 67108864"),
        (png_header_bomb(20000), "too large to decode"),  # Pillow's own check, at 2x the server's cap
    ]
    for data, match in cases:
        start = time.monotonic()
        with pytest.raises(MediaError, match=match):
            process_image(data, MediaConfig(), MediaLimits())
        assert time.monotonic() - start < 2.0, match


# --- isolation ----------------------------------------------------------------------------------------------


def test_loop_and_text_path_stay_responsive_while_media_attacks_run(demo, server):
    """8 never-answering URLs, a GIF refused by its budget, a GIF that decodes for seconds, a gzip bomb: the
    loop's heartbeat and a text request tokenised on its own executor (as the server's text path does) stay
    within 1 s, and every offender gets its error promptly."""
    tokenizer = demo[2]
    text_pool = ThreadPoolExecutor(1, thread_name_prefix="text")
    text = [{"role": "user", "content": "Describe the tomb."}]
    heavy = data_url(hostile_gif(2000, 2000, 600), "image/gif")

    async def main():
        s = settings(demo, FetchPolicy(allowed_domains=LOCAL.allowed_domains, timeout_s=2.0))
        stop, late, text_s = asyncio.Event(), [0.0], [0.0]

        async def heartbeat():
            while not stop.is_set():
                start = time.monotonic()
                await asyncio.sleep(0.01)
                late[0] = max(late[0], time.monotonic() - start - 0.01)

        async def text_requests():
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                start = time.monotonic()
                await loop.run_in_executor(text_pool, chat_prompt, tokenizer, text)
                text_s[0] = max(text_s[0], time.monotonic() - start)
                await asyncio.sleep(0.1)

        async def timed(parts):
            start = time.monotonic()
            try:
                await multimodal_prompt(s, tokenizer, ask(*parts))
                return "ok", time.monotonic() - start
            except MediaError as e:
                return str(e), time.monotonic() - start

        watchers = [asyncio.create_task(heartbeat()), asyncio.create_task(text_requests())]
        await asyncio.sleep(0.2)
        results = await asyncio.gather(
            timed([("image_url", server.url("/silent"))] * 8),
            timed([("video_url", data_url(hostile_gif(8000, 8000, 500), "image/gif"))]),
            timed([("video_url", heavy)]),
            timed([("image_url", server.url("/gzip-bomb"))]),
        )
        stop.set()
        await asyncio.gather(*watchers)
        return results, late[0], text_s[0]

    try:
        (silent, budget, heavy_gif, bomb), late, text_s = asyncio.run(main())
    finally:
        text_pool.shutdown()
    assert late < 1.0 and text_s < 1.0, (late, text_s)
    assert "timed out" in silent[0] and silent[1] < 3.5, silent
    assert "pixels to decode" in budget[0] and budget[1] < 2.0, budget
    assert "larger than" in bomb[0] and bomb[1] < 2.0, bomb
    assert heavy_gif[0] == "ok", heavy_gif


class _NoDefaultExecutor(ThreadPoolExecutor):
    def submit(self, *args, **kwargs):
        raise AssertionError("media work reached the event loop's default executor")


def test_media_work_never_uses_the_loops_default_executor(demo, tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes(32, 32))
    with HostileServer() as srv:
        url = srv.add("/img", image_bytes(40, 40)).replace("127.0.0.1", "localhost")  # a name to resolve
        policy = FetchPolicy(tmp_path, frozenset({"localhost"}), timeout_s=5.0)
        parts = [("image_url", url), ("image_url", (tmp_path / "a.png").as_uri())]
        parts.append(("image_url", data_url(image_bytes(24, 24), "image/png")))

        async def main():
            asyncio.get_running_loop().set_default_executor(_NoDefaultExecutor(1))
            return await multimodal_prompt(settings(demo, policy), demo[2], ask(*parts))

        ids, mm = asyncio.run(main())
    assert len(mm.items) == 3


# --- honest errors ------------------------------------------------------------------------------------------


def test_nul_bytes_and_malformed_urls_and_redirects_are_media_errors(server, tmp_path):
    policy = FetchPolicy(tmp_path, LOCAL.allowed_domains, timeout_s=2.0)
    redirects = {
        "/r-idna": "https://xn--/",
        "/r-port": "http://127.0.0.1:99999/x",
        "/r-ctl": "http://127.0.0.1/\x7f",
        "/r-scheme": "file:///etc/passwd",
    }
    for path, location in redirects.items():
        server.add(path, status=302, headers={"Location": location})
    urls = [server.url(p) for p in ["/bad-redirect", "/no-location", "/loop", *redirects]]
    urls += ["file:///etc/pass%00wd", "file:///etc/pass\x00wd", "file://[/x", "https://xn--/a.png", "http://[::1"]
    for url in urls:
        with pytest.raises(MediaError) as e:
            fetch_bytes(url, policy, 1 << 20)
        assert str(tmp_path) not in str(e.value), url


def test_fetch_is_a_coroutine_on_the_callers_loop(server):
    async def main():
        return await fetch_url(server.add("/x", b"abc"), LOCAL, 100)

    assert asyncio.run(main()) == b"abc"
