package idempotency

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
)

// Defect (a), across a client rebuild (and on one server): an Any whose
// type is linked in "counts as the message it packs", and a scalar equal
// to its default "counts as absent, so adding or removing presence changes
// nothing". But an Any with an empty value has no value entry at all,
// while one whose value is an explicit default ("08 00": notify = false,
// written by a client rebuilt with `optional bool notify`, or by any
// encoder that writes explicit zeros) has a value entry of form any,
// unpacked to Opts{} with nothing present. absentAlike finds the value
// field present on one side only, of form any, and answers "different":
// the genuine retry is KEY_REUSED and the client is told to use a new key.
// The same change on a field of the request itself replays.
//
// Correct behaviour: Any{Opts, ""} and Any{Opts, "08 00"} with Opts
// linked in both unpack to Opts{}: the same request (sameRequest true),
// as {notify: false} and {} are at the top level.
func TestAdv2FPLinkedAnyEmptyValueAndExplicitDefaultAreOneRequest(t *testing.T) {
	t.Parallel()
	opts := advSchema(t, "adv2anyopt", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("notify", 1, descriptorpb.FieldDescriptorProto_TYPE_BOOL, optional)}})
	require.NoError(t, protoregistry.GlobalTypes.RegisterMessage(dynamicpb.NewMessageType(opts)))
	md := advSchema(t, "adv2anyreq", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		field("notify", 2, descriptorpb.FieldDescriptorProto_TYPE_BOOL, optional),
		advMsgField("opts", 3, ".google.protobuf.Any", optional)}}, "google/protobuf/any.proto")
	req := func(notify []byte, packed []byte) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
		b = append(b, notify...)
		if packed != nil {
			a, err := proto.Marshal(&anypb.Any{TypeUrl: "type.googleapis.com/adv.adv2anyopt.M", Value: packed})
			require.NoError(t, err)
			b = protowire.AppendBytes(protowire.AppendTag(b, 3, protowire.BytesType), a)
		}
		return b
	}
	explicitFalse := []byte{0x08, 0x00}
	require.True(t, sameRequest(fpOf(t, md, req(nil, nil)), fpOf(t, md, req([]byte{0x10, 0x00}, nil))),
		"sanity: at the top level, notify=false written or not is the same request")
	require.False(t, sameRequest(fpOf(t, md, req(nil, []byte{})), fpOf(t, md, req(nil, []byte{0x08, 0x01}))),
		"sanity: notify=true in the Any is another request")
	require.True(t, sameRequest(fpOf(t, md, req(nil, []byte{})), fpOf(t, md, req(nil, explicitFalse))),
		"Any{Opts{}} encoded empty, then with notify=false written: the same request")
	require.True(t, sameRequest(fpOf(t, md, req(nil, explicitFalse)), fpOf(t, md, req(nil, []byte{}))))
}
