package idempotency

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestUnitFingerprint(t *testing.T) {
	t.Parallel()
	fp := func(method, body string) []byte {
		b, err := Fingerprint(method, wrapperspb.String(body))
		require.NoError(t, err)
		return b
	}
	require.Equal(t, byte(fieldsVersion), versionOf(fp("/a/M", "x")))
	require.Equal(t, fp("/a/M", "x"), fp("/a/M", "x"), "stable")
	require.False(t, sameRequest(fp("/a/M", "x"), fp("/a/M", "y")), "another body")
	require.False(t, sameRequest(fp("/a/M", "x"), fp("/a/N", "x")), "another method")
	// The method and the body are separated, so they cannot trade bytes.
	require.NotEqual(t, fp("/a/M", "\x0a\x01x"), fp("/a/M\x0a", "\x01x"))
	require.True(t, sameRequest(fp("/a/M", "x"), fp("/a/M", "x")))
}

// requestSchema builds the schema of a request, as two releases of a
// service might have it: "old" knows field 1 only; "new" also knows field 5,
// a map<string, string>.
func requestSchema(t *testing.T, withMap bool) protoreflect.MessageType {
	t.Helper()
	msg := &descriptorpb.DescriptorProto{
		Name:  proto.String("Req"),
		Field: []*descriptorpb.FieldDescriptorProto{{Name: proto.String("note"), Number: proto.Int32(1), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}},
	}
	if withMap {
		msg.Field = append(msg.Field, &descriptorpb.FieldDescriptorProto{
			Name: proto.String("tags"), Number: proto.Int32(5), Label: descriptorpb.FieldDescriptorProto_LABEL_REPEATED.Enum(),
			Type: descriptorpb.FieldDescriptorProto_TYPE_MESSAGE.Enum(), TypeName: proto.String(".fp.Req.TagsEntry"),
		})
		msg.NestedType = []*descriptorpb.DescriptorProto{{
			Name: proto.String("TagsEntry"), Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
			Field: []*descriptorpb.FieldDescriptorProto{
				{Name: proto.String("key"), Number: proto.Int32(1), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), JsonName: proto.String("key")},
				{Name: proto.String("value"), Number: proto.Int32(2), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), JsonName: proto.String("value")},
			},
		}}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("fp.proto"), Package: proto.String("fp"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{msg},
	}, nil)
	require.NoError(t, err)
	return dynamicpb.NewMessageType(fd.Messages().ByName("Req"))
}

// wireRequest encodes note and a three-entry map, the entries in the given
// order, as clients that re-marshal each attempt do.
func wireRequest(order ...int) []byte {
	tags := [][2]string{{"a", "1"}, {"b", "2"}, {"c", "3"}}
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	b = protowire.AppendString(b, "charge")
	for _, i := range order {
		entry := protowire.AppendTag(nil, 1, protowire.BytesType)
		entry = protowire.AppendString(entry, tags[i][0])
		entry = protowire.AppendTag(entry, 2, protowire.BytesType)
		entry = protowire.AppendString(entry, tags[i][1])
		b = protowire.AppendTag(b, 5, protowire.BytesType)
		b = protowire.AppendBytes(b, entry)
	}
	return b
}

// A newer client's request, retried with its map encoded in another order,
// is the same request: on a server that does not know the map (its bytes
// are unknown fields), on one that does, and across the two during a
// rolling deploy.
func TestUnitFingerprintSurvivesRetriesAndDeploys(t *testing.T) {
	t.Parallel()
	oldType, newType := requestSchema(t, false), requestSchema(t, true)
	fp := func(mt protoreflect.MessageType, wire []byte) []byte {
		m := mt.New().Interface()
		require.NoError(t, proto.Unmarshal(wire, m))
		b, err := Fingerprint("/fp.Svc/Charge", m)
		require.NoError(t, err)
		return b
	}
	first, retry := wireRequest(0, 1, 2), wireRequest(2, 0, 1)
	require.NotEqual(t, first, retry)

	require.Equal(t, fp(oldType, first), fp(oldType, retry), "old server: unknown fields do not count")
	require.Equal(t, fp(newType, first), fp(newType, retry), "new server: map order does not count")
	require.True(t, sameRequest(fp(oldType, first), fp(newType, retry)), "mid-deploy: not comparable, so the same request")
	require.True(t, sameRequest(fp(newType, first), fp(oldType, retry)))

	other := append(protowire.AppendTag(nil, 1, protowire.BytesType), protowire.AppendString(nil, "refund")...)
	require.False(t, sameRequest(fp(newType, first), fp(newType, other)), "a known field changed: another request")
	require.False(t, sameRequest(fp(oldType, first), fp(oldType, other)))

	legacy := make([]byte, 32) // the first release's untagged SHA-256
	require.True(t, sameRequest(legacy, fp(newType, first)), "an older algorithm's fingerprint is not compared")
	require.False(t, sameRequest([]byte("mine-1"), []byte("mine-2")), "untagged fingerprints compare byte for byte")
	require.True(t, sameRequest([]byte("mine-1"), []byte("mine-1")))
}
