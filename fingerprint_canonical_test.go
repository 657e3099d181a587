package idempotency

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// fpOf fingerprints wire decoded as md, as a server with that schema does.
func fpOf(t *testing.T, md protoreflect.MessageDescriptor, wire []byte) []byte {
	t.Helper()
	m := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(wire, m))
	fp, err := Fingerprint("/fp.Svc/Call", m)
	require.NoError(t, err)
	return fp
}

func mustFP(t *testing.T, m proto.Message) []byte {
	t.Helper()
	fp, err := Fingerprint("/fp.Svc/Call", m)
	require.NoError(t, err)
	return fp
}

// schemaOf builds message "fp.M" of one file from fields and nested types.
func schemaOf(t *testing.T, syntax string, msg *descriptorpb.DescriptorProto, enums ...*descriptorpb.EnumDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	msg.Name = proto.String("M")
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("fp_canonical.proto"), Package: proto.String("fp"), Syntax: proto.String(syntax),
		MessageType: []*descriptorpb.DescriptorProto{msg}, EnumType: enums,
	}, nil)
	require.NoError(t, err)
	return fd.Messages().ByName("M")
}

func field(name string, num int32, typ descriptorpb.FieldDescriptorProto_Type, label descriptorpb.FieldDescriptorProto_Label) *descriptorpb.FieldDescriptorProto {
	return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(num), Type: typ.Enum(), Label: label.Enum(), JsonName: proto.String(name)}
}

const (
	optional = descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
	repeated = descriptorpb.FieldDescriptorProto_LABEL_REPEATED
)

// -0 is 0, and every NaN (whatever its payload) is one value, singular or
// in a list; other values still differ.
func TestUnitFingerprintFloats(t *testing.T) {
	t.Parallel()
	require.True(t, sameRequest(mustFP(t, wrapperspb.Double(math.Copysign(0, -1))), mustFP(t, wrapperspb.Double(0))))
	nan1, nan2 := math.Float64frombits(0x7ff8000000000001), math.Float64frombits(0xfff0000000abcdef)
	require.True(t, math.IsNaN(nan1) && math.IsNaN(nan2))
	require.Equal(t, mustFP(t, wrapperspb.Double(nan1)), mustFP(t, wrapperspb.Double(nan2)))
	require.Equal(t, mustFP(t, wrapperspb.Float(float32(nan1))), mustFP(t, wrapperspb.Float(float32(math.NaN()))))
	require.False(t, sameRequest(mustFP(t, wrapperspb.Double(nan1)), mustFP(t, wrapperspb.Double(1))))
	require.False(t, sameRequest(mustFP(t, wrapperspb.Double(1)), mustFP(t, wrapperspb.Double(1.0000001))))

	md := schemaOf(t, "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("xs", 1, descriptorpb.FieldDescriptorProto_TYPE_DOUBLE, repeated)}})
	list := func(xs ...float64) []byte {
		var p []byte
		for _, x := range xs {
			p = protowire.AppendFixed64(p, math.Float64bits(x))
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), p)
	}
	require.Equal(t, fpOf(t, md, list(math.Copysign(0, -1), nan1)), fpOf(t, md, list(0, nan2)))
	require.False(t, sameRequest(fpOf(t, md, list(0, 1)), fpOf(t, md, list(1, 0))), "a list's order counts")
}

// An Any counts as the message it packs, by type name: the URL's prefix,
// unknown fields in the packed message and their order do not count.
// (Unknown fields are in the Any's canonical bytes, which the fingerprint
// keeps for a comparison with an Any not unpacked; so two fingerprints
// name the same request without being equal byte for byte.)
func TestUnitFingerprintAny(t *testing.T) {
	t.Parallel()
	packed := func(url string, value []byte) []byte {
		return mustFP(t, &anypb.Any{TypeUrl: url, Value: value})
	}
	sv, err := proto.Marshal(wrapperspb.String("charge"))
	require.NoError(t, err)
	unknown := protowire.AppendVarint(protowire.AppendTag(nil, 9, protowire.VarintType), 1)
	require.Equal(t, packed("type.googleapis.com/google.protobuf.StringValue", sv), packed("example.com/google.protobuf.StringValue", sv), "the URL's prefix")
	// Unknown fields inside are the same request (the messages packed are
	// compared), though the fingerprints differ: each also keeps the Any's
	// canonical bytes, compared with an Any that could not be unpacked.
	require.True(t, sameRequest(packed("type.googleapis.com/google.protobuf.StringValue", sv), packed("google.protobuf.StringValue", append(slicesClone(unknown), sv...))), "unknown fields inside")
	require.False(t, sameRequest(packed("x/google.protobuf.StringValue", sv), packed("x/google.protobuf.BytesValue", sv)), "another type")
	other, err := proto.Marshal(wrapperspb.String("refund"))
	require.NoError(t, err)
	require.False(t, sameRequest(packed("x/google.protobuf.StringValue", sv), packed("x/google.protobuf.StringValue", other)), "another value")

	// A type the server does not link in: its bytes, each level sorted.
	entry := func(k, v string) []byte {
		e := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), k)
		e = protowire.AppendString(protowire.AppendTag(e, 2, protowire.BytesType), v)
		return protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), e)
	}
	a, b, c := entry("a", "1"), entry("b", "2"), entry("c", "3")
	join := func(parts ...[]byte) []byte { return []byte(strings.Join(toStrings(parts), "")) }
	require.Equal(t, packed("type.googleapis.com/acme.Unlinked", join(a, b, c)), packed("example.com/acme.Unlinked", join(c, a, b)), "map order of an unlinked type")
	require.False(t, sameRequest(packed("x/acme.Unlinked", join(a, b)), packed("x/acme.Unlinked", join(a, c))))
	require.False(t, sameRequest(packed("x/acme.Unlinked", join(a, b)), packed("x/google.protobuf.StringValue", sv)), "another type name")
}

func slicesClone(b []byte) []byte { return append([]byte(nil), b...) }

func toStrings(parts [][]byte) []string {
	out := make([]string, len(parts))
	for i, p := range parts {
		out[i] = string(p)
	}
	return out
}

// Fingerprints stored by earlier releases (version 2, untagged) never make
// a request with a version 3 fingerprint KEY_REUSED; a version 3 one that
// does not parse is only ever the same as itself.
func TestUnitFingerprintOlderFormats(t *testing.T) {
	t.Parallel()
	current := mustFP(t, wrapperspb.String("x"))
	v2 := tagged(kindDigest("proto"), []byte("/fp.Svc/Call"), []byte("anything"))
	require.Equal(t, byte(fingerprintVersion), versionOf(v2))
	require.True(t, sameRequest(v2, current))
	require.True(t, sameRequest(make([]byte, 32), current))
	require.False(t, sameRequest(v2, tagged(kindDigest("proto"), []byte("/fp.Svc/Call"), []byte("other"))), "version 2 still compares with itself")
	require.True(t, sameRequest(v2, tagged(kindDigest("another schema"), []byte("other"))))

	broken := append(slicesClone(current[:fieldsHeadLen]), 0x05, 0xff)
	require.Equal(t, byte(fieldsVersion), versionOf(broken))
	require.True(t, sameRequest(broken, broken))
	require.False(t, sameRequest(broken, current))
	other, err := Fingerprint("/fp.Svc/Other", wrapperspb.String("x"))
	require.NoError(t, err)
	require.False(t, sameRequest(current, other), "another method")
}

// A closed enum gains a value: the same bytes are the same request on both
// schemas, though the older one drops the value it does not know.
func TestUnitFingerprintClosedEnumGainsAValue(t *testing.T) {
	t.Parallel()
	schema := func(values ...int32) protoreflect.MessageDescriptor {
		enum := &descriptorpb.EnumDescriptorProto{Name: proto.String("E")}
		for _, v := range values {
			enum.Value = append(enum.Value, &descriptorpb.EnumValueDescriptorProto{Name: proto.String("E" + string(rune('A'+v))), Number: proto.Int32(v)})
		}
		f := field("e", 1, descriptorpb.FieldDescriptorProto_TYPE_ENUM, optional)
		f.TypeName = proto.String(".fp.E")
		return schemaOf(t, "proto2", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{f,
			field("amount", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}}, enum)
	}
	v1, v2 := schema(1, 2), schema(1, 2, 3)
	wire := func(e, amount uint64) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), e)
		return protowire.AppendVarint(protowire.AppendTag(b, 2, protowire.VarintType), amount)
	}
	require.True(t, sameRequest(fpOf(t, v1, wire(3, 5)), fpOf(t, v2, wire(3, 5))))
	require.True(t, sameRequest(fpOf(t, v2, wire(3, 5)), fpOf(t, v1, wire(3, 5))))
	require.False(t, sameRequest(fpOf(t, v1, wire(3, 5)), fpOf(t, v2, wire(3, 6))), "another amount")
	require.False(t, sameRequest(fpOf(t, v2, wire(2, 5)), fpOf(t, v2, wire(3, 5))), "another value both know")
	require.False(t, sameRequest(fpOf(t, v1, wire(2, 5)), fpOf(t, v1, wire(1, 5))))
}

// A field moved into a oneof is not compared (the same bytes decode to
// other values when two members are sent); its neighbours still are.
func TestUnitFingerprintFieldMovedIntoAOneof(t *testing.T) {
	t.Parallel()
	fields := func() []*descriptorpb.FieldDescriptorProto {
		return []*descriptorpb.FieldDescriptorProto{
			field("a", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
			field("b", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
			field("amount", 3, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		}
	}
	v1 := schemaOf(t, "proto3", &descriptorpb.DescriptorProto{Field: fields()})
	f := fields()
	f[0].OneofIndex, f[1].OneofIndex = proto.Int32(0), proto.Int32(0)
	v2 := schemaOf(t, "proto3", &descriptorpb.DescriptorProto{Field: f, OneofDecl: []*descriptorpb.OneofDescriptorProto{{Name: proto.String("choice")}}})
	wire := func(amount uint64) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 1)
		b = protowire.AppendVarint(protowire.AppendTag(b, 2, protowire.VarintType), 2)
		return protowire.AppendVarint(protowire.AppendTag(b, 3, protowire.VarintType), amount)
	}
	require.True(t, sameRequest(fpOf(t, v1, wire(5)), fpOf(t, v2, wire(5))))
	require.False(t, sameRequest(fpOf(t, v1, wire(5)), fpOf(t, v2, wire(6))))
}

// Fingerprints stay bounded: a message nested deeper than maxNodeDepth is
// kept as one leaf (a change in it still counts), and a request with more
// fields than fit in maxFieldsLen is one leaf as a whole.
func TestUnitFingerprintIsBounded(t *testing.T) {
	t.Parallel()
	next := field("next", 1, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, optional)
	next.TypeName = proto.String(".fp.M")
	md := schemaOf(t, "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{next,
		field("v", 2, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional)}})
	var nested func(depth int, v string) []byte
	nested = func(depth int, v string) []byte {
		b := protowire.AppendString(protowire.AppendTag(nil, 2, protowire.BytesType), v)
		if depth > 0 {
			b = protowire.AppendBytes(protowire.AppendTag(b, 1, protowire.BytesType), nested(depth-1, v))
		}
		return b
	}
	deep := fpOf(t, md, nested(40, "x"))
	require.Less(t, len(deep), 600)
	require.True(t, sameRequest(deep, fpOf(t, md, nested(40, "x"))))
	require.False(t, sameRequest(deep, fpOf(t, md, nested(40, "y"))))

	wide := &descriptorpb.DescriptorProto{}
	for i := range int32(3000) {
		wide.Field = append(wide.Field, field("f"+string(rune('a'+i%26))+strings.Repeat("_", int(i/26)), i+1, descriptorpb.FieldDescriptorProto_TYPE_STRING, repeated))
	}
	wmd := schemaOf(t, "proto3", wide)
	all := func(v string) []byte {
		var b []byte
		for i := range 3000 {
			b = protowire.AppendString(protowire.AppendTag(b, protowire.Number(i+1), protowire.BytesType), v)
		}
		return b
	}
	big := fpOf(t, wmd, all("x"))
	require.LessOrEqual(t, len(big), maxFieldsLen)
	require.True(t, sameRequest(big, fpOf(t, wmd, all("x"))))
	require.False(t, sameRequest(big, fpOf(t, wmd, all("y"))))
}

// Lists and maps of messages are compared element by element: another
// element, another order of a list, another length, another key are other
// requests; a map's order is not.
func TestUnitFingerprintListsAndMapsOfMessages(t *testing.T) {
	t.Parallel()
	msgField := func(name string, num int32, typeName string, label descriptorpb.FieldDescriptorProto_Label) *descriptorpb.FieldDescriptorProto {
		f := field(name, num, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, label)
		f.TypeName = proto.String(typeName)
		return f
	}
	item := &descriptorpb.DescriptorProto{Name: proto.String("Item"), Field: []*descriptorpb.FieldDescriptorProto{
		field("sku", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}}
	entry := &descriptorpb.DescriptorProto{Name: proto.String("ByEntry"), Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
		Field: []*descriptorpb.FieldDescriptorProto{field("key", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional),
			msgField("value", 2, ".fp.M.Item", optional)}}
	md := schemaOf(t, "proto3", &descriptorpb.DescriptorProto{NestedType: []*descriptorpb.DescriptorProto{item, entry}, Field: []*descriptorpb.FieldDescriptorProto{
		msgField("items", 1, ".fp.M.Item", repeated), msgField("by", 2, ".fp.M.ByEntry", repeated)}})
	it := func(sku uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), sku)
	}
	list := func(skus ...uint64) []byte {
		var b []byte
		for _, s := range skus {
			b = protowire.AppendBytes(protowire.AppendTag(b, 1, protowire.BytesType), it(s))
		}
		return b
	}
	byKey := func(kv ...any) []byte {
		var b []byte
		for i := 0; i < len(kv); i += 2 {
			e := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), kv[i].(string))
			e = protowire.AppendBytes(protowire.AppendTag(e, 2, protowire.BytesType), it(uint64(kv[i+1].(int))))
			b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), e)
		}
		return b
	}
	require.True(t, sameRequest(fpOf(t, md, list(1, 2)), fpOf(t, md, list(1, 2))))
	require.False(t, sameRequest(fpOf(t, md, list(1, 2)), fpOf(t, md, list(1, 3))), "another element")
	require.False(t, sameRequest(fpOf(t, md, list(1, 2)), fpOf(t, md, list(2, 1))), "a list's order counts")
	require.False(t, sameRequest(fpOf(t, md, list(1, 2)), fpOf(t, md, list(1))), "another length")
	require.False(t, sameRequest(fpOf(t, md, list(1)), fpOf(t, md, nil)), "a list against none")
	require.Equal(t, fpOf(t, md, byKey("a", 1, "b", 2)), fpOf(t, md, byKey("b", 2, "a", 1)), "a map's order does not count")
	require.False(t, sameRequest(fpOf(t, md, byKey("a", 1, "b", 2)), fpOf(t, md, byKey("a", 1, "b", 3))), "another value")
	require.False(t, sameRequest(fpOf(t, md, byKey("a", 1)), fpOf(t, md, byKey("c", 1))), "another key")
}

// A request whose fingerprint would outgrow maxFieldsLen is cut: the
// fields before the cut are compared with any request, those after it
// with another cut request of the same schema only, so a retry across a
// deploy still replays.
func TestUnitFingerprintCutRequests(t *testing.T) {
	t.Parallel()
	schema := func(file string, fields int32) protoreflect.MessageDescriptor {
		msg := &descriptorpb.DescriptorProto{Name: proto.String("M"), Field: []*descriptorpb.FieldDescriptorProto{
			field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}}
		for i := int32(2); i <= fields; i++ {
			msg.Field = append(msg.Field, field(fmt.Sprintf("n%d", i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
		}
		fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
			Name: proto.String("fp_" + file + ".proto"), Package: proto.String("fp." + file), Syntax: proto.String("proto3"),
			MessageType: []*descriptorpb.DescriptorProto{msg},
		}, nil)
		require.NoError(t, err)
		return fd.Messages().Get(0)
	}
	v1, v2 := schema("cut1", 1200), schema("cut2", 1300)
	req := func(amount uint64, last string) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), amount)
		for i := 2; i < 1200; i++ {
			b = protowire.AppendString(protowire.AppendTag(b, protowire.Number(i), protowire.BytesType), "n")
		}
		return protowire.AppendString(protowire.AppendTag(b, 1200, protowire.BytesType), last)
	}
	first := fpOf(t, v1, req(100, "x"))
	require.LessOrEqual(t, len(first), maxFieldsLen)
	require.True(t, sameRequest(first, fpOf(t, v1, req(100, "x"))))
	require.False(t, sameRequest(first, fpOf(t, v1, req(100, "y"))), "one schema: the last field, after the cut, still counts")
	require.False(t, sameRequest(first, fpOf(t, v2, req(999, "x"))), "across a deploy: a field before the cut")
	require.True(t, sameRequest(first, fpOf(t, v2, req(100, "x"))), "across a deploy: the genuine retry")
	require.True(t, sameRequest(fpOf(t, v2, req(100, "x")), first))
}
