"""Which batch goes where, and when: the dispatcher of each lane (cut, lease a staging slab,
decode, place on a device), a lane's fused route on one CPU device, the placement across
devices, the admission across lanes sharing a device, and the selection of devices from the
config. One device's runtime is :mod:`streamproc.device`."""
