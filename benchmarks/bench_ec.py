#!/usr/bin/env python3
"""Erasure-coding libraries for `--parity K+M`, on shard-sized data: encode and rebuild rates.

The layout `--parity` needs: a group of K data shards stays as it is (readable by tar,
webdataset, DALI and h5py); M parity shards hold, for each offset, the parity of the K data
shards' bytes at that offset, cell by cell (a shard shorter than the longest is read as zeros
past its end, never padded on disk). So a library must give "K cells in, M parity cells out"
and "any K of the K+M cells in, the lost ones out", streamed cell by cell in bounded memory.

Candidates (each is asked for exactly that):

- pyeclib (BSD-2; bundles liberasurecode and ISA-L): ``ECDriver.encode`` of the K cells laid
  end to end returns K + M fragments whose payloads are the K cells and the M parity cells,
  each behind an 80-byte header that depends only on (K, M, cell size, backend): no payload
  checksum. So parity shards store the payloads only, and a rebuild gives each surviving
  cell the header of an encode of zeros of the same shape (checked here byte for byte: the
  rebuilt cell must equal the lost one). Backends: ``isa_l_rs_vand``,
  ``liberasurecode_rs_vand``.
- zfec (GPL-2+: does not fit shardio's Apache-2.0; measured for reference): a raw
  ``Encoder(K, K+M).encode(cells)``.
- reedsolo (public domain, pure Python): a symbol codec; measured on 64 KiB only.

For each: a group of K shards of ``--shard-mib`` MiB (random bytes) is encoded cell by cell
(``--cell-kib``), and one lost data shard is rebuilt from K survivors, ``--repeat`` times;
the median rate is of the group's data bytes per second, one core. Writes the section
"## Erasure coding for --parity" of benchmarks/RESULTS.md (``--no-write`` to only print).
Needs the ``bench`` extra (pyeclib, zfec, reedsolo).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Erasure coding for --parity"
HEADER_BYTES = 80  # liberasurecode's fragment header


def _pyeclib(backend: str, k: int, m: int, cell: int) -> tuple[Callable, Callable]:
    """(encode(cells) -> parity cells, rebuild(cells with one None, parity) -> the lost cell)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pyeclib.ec_iface import ECDriver

        driver = ECDriver(k=k, m=m, ec_type=backend)
    template = [f[:HEADER_BYTES] for f in driver.encode(bytes(k * cell))]

    def encode(cells: list[bytes]) -> list[bytes]:
        fragments = driver.encode(b"".join(cells))
        return [f[HEADER_BYTES:] for f in fragments[k:]]

    def rebuild(cells: list[bytes | None], parity: list[bytes]) -> bytes:
        lost = next(i for i, c in enumerate(cells) if c is None)
        have = [template[i] + c for i, c in enumerate(cells) if c is not None]
        have += [template[k + j] + p for j, p in enumerate(parity)]
        return driver.reconstruct(have[:k], [lost])[0][HEADER_BYTES:]

    return encode, rebuild


def _zfec(k: int, m: int, cell: int) -> tuple[Callable, Callable]:
    del cell
    import zfec

    encoder, decoder = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)

    def encode(cells: list[bytes]) -> list[bytes]:
        return [bytes(b) for b in encoder.encode(cells, list(range(k, k + m)))]

    def rebuild(cells: list[bytes | None], parity: list[bytes]) -> bytes:
        lost = next(i for i, c in enumerate(cells) if c is None)
        blocks = [c for c in cells if c is not None] + parity[:1]
        nums = [i for i, c in enumerate(cells) if c is not None] + [k]
        return bytes(decoder.decode(blocks, nums)[lost])

    return encode, rebuild


def _measure(
    make: Callable[[], tuple[Callable, Callable]], k: int, shard: int, cell: int, repeat: int
) -> tuple[float, float]:
    """(encode, rebuild) median GB/s of the group's data bytes."""
    encode, rebuild = make()
    rng_cells = [[os.urandom(cell) for _ in range(k)] for _ in range(2)]  # reused: cheap data
    cells_per_shard = shard // cell
    enc_rates, reb_rates = [], []
    for _ in range(repeat):
        began = time.perf_counter()
        parity_sets = []
        for c in range(cells_per_shard):
            parity_sets.append(encode(rng_cells[c % 2]))
        enc_rates.append(k * shard / (time.perf_counter() - began) / 1e9)
        began = time.perf_counter()
        for c in range(cells_per_shard):
            cells: list[bytes | None] = list(rng_cells[c % 2])
            lost = cells[3]
            cells[3] = None
            got = rebuild(cells, parity_sets[c])
            if got != lost:
                raise SystemExit(f"{make}: the rebuilt cell differs from the lost one")
        reb_rates.append(k * shard / (time.perf_counter() - began) / 1e9)
    return statistics.median(enc_rates), statistics.median(reb_rates)


def _reedsolo(repeat: int) -> float:
    import reedsolo

    codec, data = reedsolo.RSCodec(2), os.urandom(64 * 1024)
    rates = []
    for _ in range(repeat):
        began = time.perf_counter()
        codec.encode(data)
        rates.append(len(data) / (time.perf_counter() - began) / 1e9)
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--m", type=int, default=2)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--cell-kib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=os.path.join(REPO, ".bench"))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "RESULTS.md"))
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)  # the RESULTS header describes its filesystem
    k, m, cell, shard = args.k, args.m, args.cell_kib << 10, args.shard_mib << 20
    rows = []
    candidates: list[tuple[str, str, Callable[[], tuple[Callable, Callable]]]] = [
        ("pyeclib 1.8 `isa_l_rs_vand`", "BSD-2", lambda: _pyeclib("isa_l_rs_vand", k, m, cell)),
        (
            "pyeclib 1.8 `liberasurecode_rs_vand`",
            "BSD-2",
            lambda: _pyeclib("liberasurecode_rs_vand", k, m, cell),
        ),
        ("zfec (reference)", "GPL-2+", lambda: _zfec(k, m, cell)),
    ]
    for name, licence, make in candidates:
        try:
            enc, reb = _measure(make, k, shard, cell, args.repeat)
        except ImportError as exc:
            rows.append([name, licence, f"not installed ({exc.name})", ""])
            continue
        rows.append([name, licence, f"{enc:.2f}", f"{reb:.2f}"])
        print(f"{name}: encode {enc:.2f} GB/s, rebuild one {reb:.2f} GB/s", file=sys.stderr)
    try:
        rows.append(
            ["reedsolo (64 KiB only)", "public domain", f"{_reedsolo(args.repeat):.4f}", ""]
        )
    except ImportError:
        rows.append(["reedsolo", "public domain", "not installed", ""])
    table = common.markdown_table(
        ["library, backend", "licence", "encode GB/s", "rebuild one shard GB/s"], rows
    )
    body = (
        f"One group of {k}+{m}: {k} random data shards of {args.shard_mib} MiB, encoded "
        f"{args.cell_kib} KiB cell by cell (the K cells at one offset in, the M parity cells "
        f"out), then one lost data shard rebuilt from the others and one parity shard, every "
        f"rebuilt cell compared with the lost one; rates are of the group's data bytes per "
        f"second, one core, median of {args.repeat}. "
        "`python benchmarks/bench_ec.py` (the `bench` extra).\n\n"
        + table
        + "\n\nChosen: pyeclib with `isa_l_rs_vand`. It is the fastest permissive choice "
        "(zfec is GPL-2+, reedsolo is far too slow), and it ships as a wheel with ISA-L and "
        "liberasurecode inside. Its fragment headers hold no checksum of the payload and depend "
        "only on (K, M, cell size, backend), so parity shards store the bare parity bytes and "
        "a rebuild gives each surviving cell the header of an encode of zeros of the same "
        "shape. The rebuilt cells above are byte-identical to the lost ones. An erasure code "
        "repairs only what it is told is lost: the per-fragment xxh3 the issue asks for is "
        "kept by shardio, not by the library."
    )
    print(table)
    if not args.no_write:
        common.update_section(args.out, SECTION, body, common.results_header(args.workdir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
