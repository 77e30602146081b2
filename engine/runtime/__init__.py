"""Runtime glue: autograd Functions and backends that execute a plan."""
