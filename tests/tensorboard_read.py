#!/usr/bin/python3
"""Reads TensorBoard event files without TensorBoard and without mpitrain's code.

Each record's two CRCs are checked with the crc32c package (Debian's python3-crc32c) and each
payload is decoded by Google's protobuf library (python3-protobuf) against TensorFlow's Event,
Summary and SessionLog messages, declared here field for field (tensorflow/core/util/event.proto,
tensorflow/core/framework/summary.proto). Prints one JSON object per event:
  {"file": ..., "step": ..., "wall_time": ..., "file_version": ...}
  {"file": ..., "step": ..., "scalars": {"tag": value, ...}}
  {"file": ..., "step": ..., "session_log": "START"}
Exit 1 with a line naming the file and record on a bad CRC, a short record or an undecodable one.
Usage: tensorboard_read.py DIR_OR_FILE...
"""
import json
import os
import struct
import sys

import crc32c
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto


def event_class():
    fdp = descriptor_pb2.FileDescriptorProto(name="mpitrain_test_event.proto", package="tbtest", syntax="proto3")

    def message(name, fields):
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
        return m

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("Value", [("tag", 1, F.TYPE_STRING, opt, None), ("simple_value", 2, F.TYPE_FLOAT, opt, None)])
    message("Summary", [("value", 1, F.TYPE_MESSAGE, rep, ".tbtest.Value")])
    slog = message("SessionLog", [("status", 1, F.TYPE_ENUM, opt, ".tbtest.SessionLog.SessionStatus"),
                                  ("checkpoint_path", 2, F.TYPE_STRING, opt, None),
                                  ("msg", 3, F.TYPE_STRING, opt, None)])
    enum = slog.enum_type.add(name="SessionStatus")
    for name, number in (("STATUS_UNSPECIFIED", 0), ("START", 1), ("STOP", 2), ("CHECKPOINT", 3)):
        enum.value.add(name=name, number=number)
    message("Event", [("wall_time", 1, F.TYPE_DOUBLE, opt, None), ("step", 2, F.TYPE_INT64, opt, None),
                      ("file_version", 3, F.TYPE_STRING, opt, None),
                      ("summary", 5, F.TYPE_MESSAGE, opt, ".tbtest.Summary"),
                      ("session_log", 6, F.TYPE_MESSAGE, opt, ".tbtest.SessionLog")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    desc = pool.FindMessageTypeByName("tbtest.Event")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.21
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def masked(data):
    c = crc32c.crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read(path, Event):
    with open(path, "rb") as f:
        raw = f.read()
    at, n = 0, 0
    while at < len(raw):
        where = f"{path}: record {n} at byte {at}"
        if len(raw) - at < 12:
            sys.exit(f"{where}: {len(raw) - at} bytes left, a header needs 12")
        (length,) = struct.unpack_from("<Q", raw, at)
        (length_crc,) = struct.unpack_from("<I", raw, at + 8)
        if masked(raw[at:at + 8]) != length_crc:
            sys.exit(f"{where}: the length's CRC32C does not match")
        if len(raw) - at < 16 + length:
            sys.exit(f"{where}: {length} payload bytes announced, {len(raw) - at - 16} left")
        payload = raw[at + 12:at + 12 + length]
        (payload_crc,) = struct.unpack_from("<I", raw, at + 12 + length)
        if masked(payload) != payload_crc:
            sys.exit(f"{where}: the payload's CRC32C does not match")
        e = Event()
        e.ParseFromString(payload)
        out = {"file": os.path.basename(path), "step": e.step, "wall_time": e.wall_time}
        if e.file_version:
            out["file_version"] = e.file_version
        if e.HasField("summary"):
            out["scalars"] = {v.tag: v.simple_value for v in e.summary.value}
        if e.HasField("session_log"):
            out["session_log"] = "START" if e.session_log.status == 1 else str(e.session_log.status)
        print(json.dumps(out))
        at += 16 + length
        n += 1


def main():
    Event = event_class()
    paths = []
    for a in sys.argv[1:]:
        if os.path.isdir(a):
            paths += sorted(os.path.join(a, p) for p in os.listdir(a) if "tfevents" in p)
        else:
            paths.append(a)
    if not paths:
        sys.exit("no event files given")
    for p in paths:
        read(p, Event)


if __name__ == "__main__":
    main()
