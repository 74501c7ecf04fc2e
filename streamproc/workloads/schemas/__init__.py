"""The workloads' schemas: Avro (``.avsc``), Protobuf (``.proto`` and the generated ``*_pb2``)."""
