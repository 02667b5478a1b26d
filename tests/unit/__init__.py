"""Fast in-process unit tests of the core modules, one file per module (test_<module>.py; test_layout_props.py: property
tests of the pure layout functions). Collectives run on torch's fake process group (``fake_pg.fake_world``): they move
no data, so these tests check layouts, states, buffers and which collectives are issued; numerics are checked by the
multi-process tests one directory up."""
