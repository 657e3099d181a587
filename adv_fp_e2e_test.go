package idempotency_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// advPaySchema builds "idempotency.test.PayRequest" from fields, in a file
// of its own name.
func advPaySchema(t *testing.T, file string, fields ...*descriptorpb.FieldDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/" + file + ".proto"), Package: proto.String("idempotency.test"),
		Syntax: proto.String("proto3"), Dependency: []string{"google/protobuf/any.proto"},
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("PayRequest"), Field: fields}},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().Get(0)
}

func advField(name string, num int32, typ descriptorpb.FieldDescriptorProto_Type, repeated bool, typeName string) *descriptorpb.FieldDescriptorProto {
	label := descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
	if repeated {
		label = descriptorpb.FieldDescriptorProto_LABEL_REPEATED
	}
	f := &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(num), Type: typ.Enum(), Label: label.Enum(), JsonName: proto.String(name)}
	if typeName != "" {
		f.TypeName = proto.String(typeName)
	}
	return f
}

// End to end, defect (b): `repeated google.protobuf.Any lines`. The first
// call charges one line; the same key with two lines (a different request:
// twice the charge) is answered with the first call's stored response,
// and the second line is never charged.
//
// Correct behaviour: the second call is FailedPrecondition KEY_REUSED and
// the ledger keeps one row, the first call's.
func TestAdvFPE2EListOfAnysOfAnotherLengthIsKeyReused(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	md := advPaySchema(t, "adv_lines",
		advField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, ""),
		advField("lines", 2, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, true, ".google.protobuf.Any"))
	conn := payServer(t, db.Schema, md)
	request := func(lines ...int64) []byte {
		b := varintField(nil, 1, 100)
		for _, l := range lines {
			a, err := anypb.New(wrapperspb.Int64(l))
			require.NoError(t, err)
			ab, err := proto.Marshal(a)
			require.NoError(t, err)
			b = bytesField(b, 2, ab)
		}
		return b
	}
	first := sendRaw(conn, "k-lines", request(100))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(conn, "k-lines", request(100)), "sanity: the genuine retry")
	requireKeyReused(t, sendRaw(conn, "k-lines", request(100, 100)), "two lines where the first call had one")
}

// End to end, defect (b): a request whose per-field fingerprint passes
// 16 KiB is stored as one whole-request leaf, which a small request of
// the same method is never compared with. The first call (amount 100,
// with many notes) is stored; the same key with amount 999 and no notes
// replays "charged 100".
//
// Correct behaviour: the second call is FailedPrecondition KEY_REUSED.
func TestAdvFPE2ELargeThenSmallRequestIsKeyReused(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	fields := []*descriptorpb.FieldDescriptorProto{advField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, "")}
	for i := int32(2); i <= 1200; i++ {
		fields = append(fields, advField(fmt.Sprintf("note%d", i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, false, ""))
	}
	conn := payServer(t, db.Schema, advPaySchema(t, "adv_wide", fields...))
	request := func(amount uint64, notes int) []byte {
		b := varintField(nil, 1, amount)
		for i := 2; i < 2+notes; i++ {
			b = bytesField(b, protowire.Number(i), []byte("n"))
		}
		return b
	}
	first := sendRaw(conn, "k-wide", request(100, 1000))
	require.NoError(t, first.err)
	require.Contains(t, first.resp.GetValue(), "charged 100#")
	requireKeyReused(t, sendRaw(conn, "k-wide", request(999, 0)), "amount 999 where the first call charged 100")
}
