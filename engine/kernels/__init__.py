"""Kernel kinds: one folder per kind of generated kernel (its plan, code generator and
launcher), all named in engine.kernels.registry. See README.md in this folder to add one."""
