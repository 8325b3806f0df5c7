"""The Ray layer: bundles and placement (`bundles`), the rank group (`group`), the rank actor (`actor`), a load's
steps on the driver (`loading`) and a rank's copy from a live replica (`receive`), and `raylazy.load` (`loader`)."""
