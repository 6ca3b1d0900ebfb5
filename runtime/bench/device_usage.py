"""Per device, while a several-model instance serves a trace: the weight bytes streamed into each pool and the
switches it made (the instance's /metrics), the most each pool held at once (/metrics, sampled), and the
most GPU memory each GPU held (nvidia-smi, sampled: the whole process's use, CUDA context included)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

SAMPLE_S = 0.5


@dataclass
class DeviceUsage:
    bytes_streamed: int = 0
    switches: int = 0
    pool_used_peak_bytes: int = 0
    gpu_memory_peak_bytes: int | None = None  # nvidia-smi's used memory of the GPU this device is


@dataclass
class PoolCounts:
    """An instance's /metrics, summed over models per device."""

    devices: dict[str, DeviceUsage] = field(default_factory=dict)

    @property
    def switches(self) -> int:
        return sum(d.switches for d in self.devices.values())

    @property
    def bytes_streamed(self) -> int:
        return sum(d.bytes_streamed for d in self.devices.values())


async def read_pool_counts(client: httpx.AsyncClient, url: str) -> PoolCounts:
    text = (await client.get(f"{url}/metrics", timeout=30)).text
    counts = PoolCounts()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            device = sample.labels.get("device")
            if device is None:
                continue
            usage = counts.devices.setdefault(device, DeviceUsage())
            if sample.name == "thawllm_model_switches_total":
                usage.switches += int(sample.value)
            elif sample.name == "thawllm_model_loaded_bytes_total":
                usage.bytes_streamed += int(sample.value)
            elif sample.name == "thawllm_pool_used_bytes":
                usage.pool_used_peak_bytes = int(sample.value)
    return counts


class UsageSampler:
    """Samples the pools' use (/metrics) and the GPUs' memory (nvidia-smi) every SAMPLE_S until stopped;
    keeps the peaks."""

    def __init__(self, client: httpx.AsyncClient, url: str, gpu_of: dict[str, int]) -> None:
        self.client, self.url = client, url
        self.gpu_of = gpu_of  # pool device -> the physical GPU index nvidia-smi reports it under
        self.pool_peak: dict[str, int] = {}
        self.gpu_peak: dict[int, int] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                counts = await read_pool_counts(self.client, self.url)
            except httpx.HTTPError:
                counts = PoolCounts()
            for device, usage in counts.devices.items():
                self.pool_peak[device] = max(self.pool_peak.get(device, 0), usage.pool_used_peak_bytes)
            for index, used in (await asyncio.to_thread(gpu_memory_used)).items():
                self.gpu_peak[index] = max(self.gpu_peak.get(index, 0), used)
            await asyncio.sleep(SAMPLE_S)

    def apply(self, counts: PoolCounts) -> None:
        """Put the peaks into COUNTS' devices."""
        for device, usage in counts.devices.items():
            usage.pool_used_peak_bytes = max(usage.pool_used_peak_bytes, self.pool_peak.get(device, 0))
            gpu = self.gpu_of.get(device)
            if gpu is not None and gpu in self.gpu_peak:
                usage.gpu_memory_peak_bytes = self.gpu_peak[gpu]


def gpu_memory_used() -> dict[int, int]:
    """nvidia-smi's used memory per physical GPU, in bytes ({} without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            used[int(index)] = int(mib) * 2**20
    return used


def physical_gpus(visible: str | None, devices: list[str]) -> dict[str, int]:
    """Pool device (cuda, cuda:N) -> physical GPU index, given the instance's CUDA_VISIBLE_DEVICES."""
    order = [int(g) for g in visible.split(",")] if visible else None
    out = {}
    for device in devices:
        if not device.startswith("cuda"):
            continue
        n = int(device.split(":")[1]) if ":" in device else 0
        out[device] = order[n] if order is not None and n < len(order) else n
    return out
