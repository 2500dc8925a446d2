"""The random stream a parallel program draws its masks from, apart from the user's own generator.

Random ops are drawn whole on every rank (planner/rules/random.py), so every rank needs the same
generator state, and the first state must be the one the single-device model would start from.
`ProgramRng` copies rank 0's state of the CPU generator (and of the device's, on an accelerator)
once at setup and swaps it in only while the per-rank program runs: the user's own per-rank seed
(for data sampling, say) is never overwritten, and the program's draws do not depend on what the
user draws between steps.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class ProgramRng:
    def __init__(self, group, device: torch.device, src: int, guard) -> None:
        self._device = device if device.type != "cpu" else None
        states = [torch.get_rng_state()]
        if self._device is not None:
            states.append(torch.get_device_module(self._device.type).get_rng_state(self._device))
        self._states = []
        for state in states:  # collectives take tensors on the group's device
            moved = state.to(device)
            with guard("broadcasting rank 0's random generator state"):
                dist.broadcast(moved, src=src, group=group)
            self._states.append(moved.cpu())

    @contextlib.contextmanager
    def active(self):
        """Run the block on the program's stream, then give the user's stream back."""
        devices = [self._device] if self._device is not None else []
        with torch.random.fork_rng(devices=devices, device_type=None if self._device is None else self._device.type):
            torch.set_rng_state(self._states[0])
            if self._device is not None:
                torch.get_device_module(self._device.type).set_rng_state(self._states[1], self._device)
            yield
            self._states[0] = torch.get_rng_state()
            if self._device is not None:
                self._states[1] = torch.get_device_module(self._device.type).get_rng_state(self._device)

    def states(self) -> list[torch.Tensor]:
        """The stream's generator states (CPU, then the device's): what a checkpoint keeps."""
        return [s.clone() for s in self._states]

    def load_states(self, states: list[torch.Tensor]) -> None:
        """Continue the stream from `states` (from `states()`, on any rank: every rank's stream is the same)."""
        if len(states) != len(self._states):
            raise ValueError(f"{len(states)} random generator states given; this program's stream has {len(self._states)} "
                             "(the CPU's, and the device's on an accelerator): restore states saved on the same kind of device")
        self._states = [s.clone() for s in states]
