"""The Ray layer: bundles and placement (`bundles`), the rank group (`group`), the rank actor (`actor`), reading and
copying steps (`reading`, `receive`, `replicas`), and `raylazy.load` (`loader`)."""
