package idempotency

import (
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/runtime/protoiface"
)

// A replay must be the bytes the first call sent. Protobuf marshals every
// message the same way each time but for its maps, whose entries come in
// random order unless deterministic output is asked for, which gRPC's codec
// does not ask. The engine stores the deterministic encoding; for a
// response type with a map anywhere in it, the interceptor hands gRPC the
// response as an exactMessage, which marshals to those stored bytes: on
// replays the bytes read from the row, on the first call the same
// deterministic encoding of the handler's response. Types without a map
// are handed over as they are, so that interceptors outside this one can
// still type-assert them; their encoding is the stored one anyway.

// exactResponse returns the response of res to hand to gRPC.
func exactResponse(res result) any {
	m := res.Response
	if m == nil || !hasMap(m.ProtoReflect().Descriptor()) {
		return m
	}
	b := res.response
	if res.Outcome != OutcomeReplayed || b == nil {
		var err error
		if b, err = (proto.MarshalOptions{Deterministic: true}).Marshal(m); err != nil {
			return m // it was stored, so this cannot fail; gRPC reports it if it does
		}
	}
	return &exactMessage{Message: m.ProtoReflect(), raw: b}
}

// exactMessage is a response that marshals to raw, its stored encoding. It
// is the decoded message in every other respect: an interceptor outside
// this package's reads its fields through ProtoReflect, and proto.Marshal,
// protojson and proto.Equal see the response.
type exactMessage struct {
	protoreflect.Message
	raw []byte
}

func (x *exactMessage) ProtoReflect() protoreflect.Message   { return x }
func (x *exactMessage) Interface() protoreflect.ProtoMessage { return x }
func (x *exactMessage) ProtoMethods() *protoiface.Methods    { return &exactMethods }

var exactMethods = protoiface.Methods{
	Flags: protoiface.SupportMarshalDeterministic,
	Size: func(in protoiface.SizeInput) protoiface.SizeOutput {
		return protoiface.SizeOutput{Size: len(in.Message.(*exactMessage).raw)}
	},
	Marshal: func(in protoiface.MarshalInput) (protoiface.MarshalOutput, error) {
		return protoiface.MarshalOutput{Buf: append(in.Buf, in.Message.(*exactMessage).raw...)}, nil
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
