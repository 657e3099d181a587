package idempotency_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
)

// End to end, defect (a): `google.protobuf.Any opts` whose packed type
// (Opts {bool notify = 1}) is linked into the server. The first call packs
// Opts{} as an empty value; the client, rebuilt with `optional bool
// notify` and setting notify = false (the value it had), retries with the
// value "08 00". The server decodes both to Opts{}, yet the retry is
// FailedPrecondition KEY_REUSED, which tells an obedient client to use a
// new key: it charges twice.
//
// Correct behaviour: the retry replays the first call's response, byte for
// byte, and the ledger keeps one row.
func TestAdv2FPE2ELinkedAnyExplicitDefaultRetryReplays(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	ofd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/adv2_opts.proto"), Package: proto.String("idempotency.test.adv2"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("Opts"), Field: []*descriptorpb.FieldDescriptorProto{
			advField("notify", 1, descriptorpb.FieldDescriptorProto_TYPE_BOOL, false, "")}}},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	require.NoError(t, protoregistry.GlobalTypes.RegisterMessage(dynamicpb.NewMessageType(ofd.Messages().Get(0))))
	md := advPaySchema(t, "adv2_anyopts",
		advField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, ""),
		advField("opts", 2, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false, ".google.protobuf.Any"))
	conn := payServer(t, db.Schema, md)
	request := func(packed []byte) []byte {
		a, err := proto.Marshal(&anypb.Any{TypeUrl: "type.googleapis.com/idempotency.test.adv2.Opts", Value: packed})
		require.NoError(t, err)
		return bytesField(varintField(nil, 1, 100), 2, a)
	}
	first := sendRaw(conn, "k-adv2-anyopts", request(nil))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(conn, "k-adv2-anyopts", request(nil)), "sanity: the same bytes")
	requireReplayOf(t, first, sendRaw(conn, "k-adv2-anyopts", request([]byte{0x08, 0x00})),
		"Opts{} packed with notify=false written: the same request")
}

// End to end, defect (b): a wide request type (220 fields, its row over
// 4 KiB, so left out of the fingerprint). The first call charges amount
// 100; the same key with amount 100 and field 3 set (capture_only, say)
// replays "charged 100" on the same server, no deploy.
//
// Correct behaviour: the second call is FailedPrecondition KEY_REUSED.
func TestAdv2FPE2EWideRequestWithAnotherFieldIsKeyReused(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	fields := []*descriptorpb.FieldDescriptorProto{advField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, "")}
	for i := int32(2); i <= 220; i++ {
		typ := descriptorpb.FieldDescriptorProto_TYPE_INT64
		if i%2 == 0 {
			typ = descriptorpb.FieldDescriptorProto_TYPE_STRING
		}
		fields = append(fields, advField(fmt.Sprintf("f%d", i), i, typ, false, ""))
	}
	conn := payServer(t, db.Schema, advPaySchema(t, "adv2_wide", fields...))
	first := sendRaw(conn, "k-adv2-wide", varintField(nil, 1, 100))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(conn, "k-adv2-wide", varintField(nil, 1, 100)), "sanity: the genuine retry")
	requireKeyReused(t, sendRaw(conn, "k-adv2-wide", varintField(varintField(nil, 1, 100), 3, 1)),
		"amount 100 with field 3 set where the first call had it unset")
}
