"""A TCP relay that adds a fixed one-way delay: the latency that ``tc netem`` would add on kernels without it.

    python -m benchmarks.relay --delay-ms 10 LISTEN=TARGET [LISTEN=TARGET ...]

Each ``LISTEN`` (``host:port``) accepts connections and forwards them to ``TARGET``; every chunk read from either
side is written to the other ``delay`` later, in order, so a request/reply round trip takes ``2 * delay`` more
and a stream keeps its throughput (up to what the relay can copy). Run it in the master's namespace of a
:class:`~benchmarks.netns.VirtualNetwork` so that the delayed bytes still cross the real (shaped) veth link.
It writes ``ready`` on stdout once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time

CHUNK = 256 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader -> writer, each chunk held until ``delay`` after it arrived."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    arrived = asyncio.Event()
    done = False

    async def read() -> None:
        nonlocal done
        try:
            while data := await reader.read(CHUNK):
                queue.append((time.monotonic() + delay, data))
                arrived.set()
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            arrived.set()

    async def write() -> None:
        try:
            while True:
                if not queue:
                    if done:
                        break
                    arrived.clear()
                    await arrived.wait()
                    continue
                due, data = queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                queue.popleft()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if writer.can_write_eof():
                try:
                    writer.write_eof()
                except OSError:
                    writer.close()

    await asyncio.gather(read(), write())


async def _serve(listen: str, target: str, delay: float) -> asyncio.Server:
    host, port = target.rsplit(":", 1)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(host, int(port))
        except OSError:
            w.close()
            return
        await asyncio.gather(_pump(r, tw, delay), _pump(tr, w, delay))
        for x in (w, tw):
            x.close()

    lhost, lport = listen.rsplit(":", 1)
    return await asyncio.start_server(handle, lhost, int(lport), limit=CHUNK)


async def _main(pairs: list[tuple[str, str]], delay: float) -> None:
    servers = [await _serve(listen, target, delay) for listen, target in pairs]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every byte")
    p.add_argument("pairs", nargs="+", help="LISTEN=TARGET, each host:port")
    args = p.parse_args(argv)
    pairs = []
    for pair in args.pairs:
        listen, sep, target = pair.partition("=")
        if not sep:
            p.error(f"expected LISTEN=TARGET, got {pair!r}")
        pairs.append((listen, target))
    try:
        asyncio.run(_main(pairs, args.delay_ms / 1000.0))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
