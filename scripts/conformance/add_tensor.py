#!/usr/bin/env python3
"""A copy of a GGUF with one extra F32 tensor (`d_model` small values) added: metadata and
every other tensor copied byte for byte. The engine must refuse such a file by the extra
tensor's name (issue 33's "no silent loading").

Usage: add_tensor.py SRC.gguf OUT.gguf NAME
"""

import os
import sys

import numpy as np
import gguf


def copy_with_extra(src, out, name, values):
    """Writes `src` plus the F32 tensor `name` holding `values` to `out`, atomically."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tmp = out + ".part"
    w = gguf.GGUFWriter(tmp, arch=arch, endianess=r.endianess)
    for field in r.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    values = np.asarray(values, dtype=np.float32)
    w.add_tensor_info(name, values.shape, values.dtype, values.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.write_tensor_data(values)
    w.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return r


def main():
    src, out, name = sys.argv[1], sys.argv[2], sys.argv[3]
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    d_model = r.fields[f"{arch}.embedding_length"].contents()
    copy_with_extra(src, out, name, np.full(d_model, 0.01, dtype=np.float32))


if __name__ == "__main__":
    main()
