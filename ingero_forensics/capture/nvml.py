"""NVML through ctypes: per-GPU gauges for the host sampler, when libnvidia-ml.so.1 loads.

Only cheap queries are made. PCIe throughput comes from the byte counters that
nvmlDeviceGetFieldValues returns (NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES, recent drivers),
not from nvmlDeviceGetPcieThroughput, which blocks for a 20 ms sampling window.
"""

from __future__ import annotations

import ctypes

LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
#: nvmlValueType_t -> ctypes field of nvmlValue_t
_VALUE_FIELDS = {0: "d", 1: "ui", 2: "ul", 3: "ull", 4: "sll", 5: "si", 6: "us"}


class NvmlUnavailable(Exception):
    pass


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _Value(ctypes.Union):
    _fields_ = [("d", ctypes.c_double), ("ui", ctypes.c_uint), ("ul", ctypes.c_ulong),
                ("ull", ctypes.c_ulonglong), ("sll", ctypes.c_longlong), ("si", ctypes.c_int),
                ("us", ctypes.c_ushort)]


class _FieldValue(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint),
                ("timestamp", ctypes.c_longlong), ("latencyUsec", ctypes.c_longlong),
                ("valueType", ctypes.c_int), ("nvmlReturn", ctypes.c_int), ("value", _Value)]


class Nvml:
    """An initialized NVML library with its device handles."""

    def __init__(self, library: str = LIBRARY):
        try:
            self.lib = ctypes.CDLL(library)
        except OSError as e:
            raise NvmlUnavailable(f"{library} not found ({e})") from None
        lib = self.lib
        try:
            init = getattr(lib, "nvmlInit_v2")
        except AttributeError:
            raise NvmlUnavailable(f"{library} has no nvmlInit_v2") from None
        rc = init()
        if rc != NVML_SUCCESS:
            raise NvmlUnavailable(f"nvmlInit_v2 failed ({self.error(rc)})")
        n = ctypes.c_uint()
        rc = lib.nvmlDeviceGetCount_v2(ctypes.byref(n))
        if rc != NVML_SUCCESS:
            raise NvmlUnavailable(f"nvmlDeviceGetCount_v2 failed ({self.error(rc)})")
        self.handles = []
        for i in range(n.value):
            h = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h)) == NVML_SUCCESS:
                self.handles.append((i, h))
        self._pcie = {i: True for i, _ in self.handles}

    def error(self, rc: int) -> str:
        try:
            fn = self.lib.nvmlErrorString
            fn.restype = ctypes.c_char_p
            return (fn(rc) or b"").decode() or f"error {rc}"
        except AttributeError:
            return f"error {rc}"

    def shutdown(self) -> None:
        try:
            self.lib.nvmlShutdown()
        except AttributeError:
            pass

    def sample(self) -> dict[str, dict[str, float]]:
        """{gpu index: {metric: value}} with gauges, and counters under "pcie_tx"/"pcie_rx"."""
        lib, out = self.lib, {}
        for i, h in self.handles:
            m: dict[str, float] = {}
            u = _Utilization()
            if lib.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u)) == NVML_SUCCESS:
                m["gpu.util_pct"] = u.gpu
                m["gpu.mem_util_pct"] = u.memory
            mem = _Memory()
            if lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)) == NVML_SUCCESS:
                m["gpu.mem_used_bytes"] = mem.used
            v = ctypes.c_uint()
            if lib.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM, ctypes.byref(v)) == NVML_SUCCESS:
                m["gpu.sm_clock_mhz"] = v.value
            if lib.nvmlDeviceGetMaxClockInfo(h, NVML_CLOCK_SM, ctypes.byref(v)) == NVML_SUCCESS:
                m["gpu.max_sm_clock_mhz"] = v.value
            if lib.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU, ctypes.byref(v)) == NVML_SUCCESS:
                m["gpu.temp_c"] = v.value
            if lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(v)) == NVML_SUCCESS:
                m["gpu.power_w"] = v.value / 1000.0  # mW
            r = ctypes.c_ulonglong()
            if lib.nvmlDeviceGetCurrentClocksThrottleReasons(h, ctypes.byref(r)) == NVML_SUCCESS:
                m["gpu.throttle_reasons"] = r.value
            if self._pcie[i]:
                fv = (_FieldValue * 2)()
                fv[0].fieldId = NVML_FI_DEV_PCIE_COUNT_TX_BYTES
                fv[1].fieldId = NVML_FI_DEV_PCIE_COUNT_RX_BYTES
                ok = lib.nvmlDeviceGetFieldValues(h, 2, fv) == NVML_SUCCESS
                if ok and fv[0].nvmlReturn == NVML_SUCCESS and fv[1].nvmlReturn == NVML_SUCCESS:
                    m["pcie_tx"] = _value(fv[0])
                    m["pcie_rx"] = _value(fv[1])
                else:
                    self._pcie[i] = False  # driver too old: stop asking
            out[str(i)] = m
        return out


def _value(fv: _FieldValue) -> float:
    return getattr(fv.value, _VALUE_FIELDS.get(fv.valueType, "ull"))
