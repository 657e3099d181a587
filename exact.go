package idempotency

import (
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/runtime/protoiface"
	"google.golang.org/protobuf/types/dynamicpb"
)

// A replay must be the bytes the first call sent. Protobuf marshals a
// generated message the same way each time but for its maps, whose entries
// come in random order unless deterministic output is asked for, which
// gRPC's codec does not ask; a dynamicpb message (a service built at run
// time) marshals its fields in random order too. The engine stores the
// deterministic encoding; for a response type with a map anywhere in it,
// and for any dynamicpb response, the interceptor hands gRPC the response
// as an exactMessage, which marshals deterministically: on the first call
// and on each replay (whose message is decoded from the stored bytes) that
// is the stored encoding. It marshals the message as it is when gRPC sends
// it, so an edit an interceptor outside this one makes reaches the client.
// Other types are handed over as they are, so that interceptors outside
// can still type-assert them; their encoding is the stored one anyway.

// exactResponse returns the response of res to hand to gRPC.
func exactResponse(res result) any {
	m := res.Response
	if m == nil {
		return nil
	}
	if _, dynamic := m.(*dynamicpb.Message); !dynamic && !hasMap(m.ProtoReflect().Descriptor()) {
		return m
	}
	return &exactMessage{Message: m.ProtoReflect()}
}

// exactMessage is a response that marshals deterministically. It is the
// decoded message in every other respect: an interceptor outside this
// package's reads and sets its fields through ProtoReflect, and
// proto.Marshal, protojson and proto.Equal see the response.
type exactMessage struct {
	protoreflect.Message
}

func (x *exactMessage) ProtoReflect() protoreflect.Message   { return x }
func (x *exactMessage) Interface() protoreflect.ProtoMessage { return x }
func (x *exactMessage) ProtoMethods() *protoiface.Methods    { return &exactMethods }

var exactMethods = protoiface.Methods{
	Flags: protoiface.SupportMarshalDeterministic,
	Size: func(in protoiface.SizeInput) protoiface.SizeOutput {
		return protoiface.SizeOutput{Size: proto.Size(in.Message.(*exactMessage).Message.Interface())}
	},
	Marshal: func(in protoiface.MarshalInput) (protoiface.MarshalOutput, error) {
		b, err := proto.MarshalOptions{Deterministic: true}.MarshalAppend(in.Buf, in.Message.(*exactMessage).Message.Interface())
		return protoiface.MarshalOutput{Buf: b}, err
	},
}

// mapTypes caches hasMap by message descriptor.
var mapTypes sync.Map // protoreflect.MessageDescriptor -> bool

// hasMap reports whether messages of md can hold a map: a map field of
// their own or of any message they contain.
func hasMap(md protoreflect.MessageDescriptor) bool {
	if v, ok := mapTypes.Load(md); ok {
		return v.(bool)
	}
	v := containsMap(md, map[protoreflect.FullName]bool{})
	mapTypes.Store(md, v)
	return v
}

func containsMap(md protoreflect.MessageDescriptor, seen map[protoreflect.FullName]bool) bool {
	if seen[md.FullName()] {
		return false
	}
	seen[md.FullName()] = true
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if fd.IsMap() || (fd.Message() != nil && containsMap(fd.Message(), seen)) {
			return true
		}
	}
	return false
}
