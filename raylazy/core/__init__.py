"""The pure core: headers parsed from bytes, dtypes, the mesh, placements and rules, pipeline stages, options, the
plan and its schedules. No I/O and no Ray: everything here works on data already read, and plans are immutable
data (pickle, JSON, tables)."""
