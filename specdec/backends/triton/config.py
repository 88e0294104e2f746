"""Tile and launch settings of the project's Triton attention kernels."""

from __future__ import annotations

import attrs


def _power_of_two_at_least(minimum: int):
    def check(instance, attribute, value):
        if value is None:
            return
        if not isinstance(value, int) or value < minimum or value & (value - 1):
            raise ValueError(
                f"KernelConfig.{attribute.name} must be a power of two >= {minimum} (or None for automatic), "
                f"got {value!r}"
            )

    return check


@attrs.frozen
class KernelConfig:
    """Overrides for the automatic choices; ``None`` means "pick from the shapes and the device".

    ``block_m``: query rows (token x head-of-group) per program; ``block_n``: keys per inner step;
    ``num_splits``: key-range splits per program row (flash-decoding), merged by a second kernel.
    """

    block_m: int | None = attrs.field(default=None, validator=_power_of_two_at_least(16))
    block_n: int | None = attrs.field(default=None, validator=_power_of_two_at_least(16))
    num_splits: int | None = attrs.field(default=None, validator=_power_of_two_at_least(1))
    num_warps: int | None = attrs.field(default=None, validator=_power_of_two_at_least(1))
    num_stages: int | None = attrs.field(default=None)

    @num_stages.validator
    def _check_stages(self, attribute, value):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"KernelConfig.num_stages must be a positive int (or None), got {value!r}")
