package idempotency

import (
	"bytes"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
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

// fpSchema builds message "adv.<file>.M" in a file of its own that may
// import the well-known types.
func fpSchema(t *testing.T, file, syntax string, msg *descriptorpb.DescriptorProto, deps ...string) protoreflect.MessageDescriptor {
	t.Helper()
	msg.Name = proto.String("M")
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/" + file + ".proto"), Package: proto.String("adv." + file), Syntax: proto.String(syntax),
		Dependency: deps, MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().ByName("M")
}

func fpMsgField(name string, num int32, typeName string, label descriptorpb.FieldDescriptorProto_Label) *descriptorpb.FieldDescriptorProto {
	f := field(name, num, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, label)
	f.TypeName = proto.String(typeName)
	return f
}

func fpAny(t *testing.T, m proto.Message) []byte {
	t.Helper()
	a, err := anypb.New(m)
	require.NoError(t, err)
	b, err := proto.Marshal(a)
	require.NoError(t, err)
	return b
}

// The defect: a list (or map) of messages is one leaf whose schema digest
// is salted with what its *values* hold (walker.dyn: one entry per Any
// and per extension present). Two different lists of Anys on one server,
// one schema, no deploy, then have different digests, sameEntry calls them
// "not comparable", and the second request replays the first's response.
//
// What holds now: on one schema, [Any(100)] and [Any(100), Any(100)]
// (one charge line against two), or [Any(StringValue)] against
// [Any(Int64Value)], are different requests: sameRequest is false, so the
// key is KEY_REUSED.
func TestFingerprintListOfAnysOfAnotherLengthIsAnotherRequest(t *testing.T) {
	t.Parallel()
	md := fpSchema(t, "anylist", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		fpMsgField("lines", 2, ".google.protobuf.Any", repeated),
	}}, "google/protobuf/any.proto")
	req := func(lines ...proto.Message) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
		for _, l := range lines {
			b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), fpAny(t, l))
		}
		return b
	}
	one := fpOf(t, md, req(wrapperspb.Int64(100)))
	require.True(t, sameRequest(one, fpOf(t, md, req(wrapperspb.Int64(100)))), "sanity: the same request")
	require.False(t, sameRequest(one, fpOf(t, md, req(wrapperspb.Int64(999)))), "sanity: another value, same length, is compared")

	require.False(t, sameRequest(one, fpOf(t, md, req(wrapperspb.Int64(100), wrapperspb.Int64(100)))),
		"a list of one Any and a list of two Anys are different requests on the same schema")
	require.False(t, sameRequest(one, fpOf(t, md, req(wrapperspb.String("100")))),
		"a list holding an Int64Value and one holding a StringValue are different requests")
}

// The defect, same family: a list of proto2 messages with an extension
// range; an extension present in one request's element and not in the
// other's salts the leaf digest, so the lists are never compared.
//
// What holds now: [{sku: 1, gift: true}] and [{sku: 2}] on one build
// (the extension linked in) are different requests.
func TestFingerprintListWithExtensionInOneRequestOnlyIsCompared(t *testing.T) {
	t.Parallel()
	item := &descriptorpb.DescriptorProto{
		Name:           proto.String("Item"),
		Field:          []*descriptorpb.FieldDescriptorProto{field("sku", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)},
		ExtensionRange: []*descriptorpb.DescriptorProto_ExtensionRange{{Start: proto.Int32(100), End: proto.Int32(200)}},
	}
	gift := field("gift", 100, descriptorpb.FieldDescriptorProto_TYPE_BOOL, optional)
	gift.Extendee = proto.String(".adv.extlist.Item")
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/extlist.proto"), Package: proto.String("adv.extlist"), Syntax: proto.String("proto2"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("M"), Field: []*descriptorpb.FieldDescriptorProto{
			fpMsgField("items", 1, ".adv.extlist.Item", repeated)}}, item},
		Extension: []*descriptorpb.FieldDescriptorProto{gift},
	}, nil)
	require.NoError(t, err)
	types := new(protoregistry.Types)
	require.NoError(t, types.RegisterExtension(dynamicpb.NewExtensionType(fd.Extensions().Get(0))))
	md := fd.Messages().ByName("M")
	fp := func(wire []byte) []byte {
		m := dynamicpb.NewMessage(md)
		require.NoError(t, proto.UnmarshalOptions{Resolver: types}.Unmarshal(wire, m))
		return mustFP(t, m)
	}
	itemWire := func(sku uint64, withGift bool) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), sku)
		if withGift {
			b = protowire.AppendVarint(protowire.AppendTag(b, 100, protowire.VarintType), 1)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), b)
	}
	require.False(t, sameRequest(fp(itemWire(1, false)), fp(itemWire(2, false))), "sanity: another sku")
	require.False(t, sameRequest(fp(itemWire(1, true)), fp(itemWire(2, false))),
		"another sku, and the extension set in one request only: a different request on one build")
}

// The defect: a request whose per-field fingerprint outgrows maxFieldsLen
// becomes one leaf under field number 0. Another request of the same
// method that stays small has no field number in common with it, so
// sameNode finds nothing to compare and calls them the same request.
//
// What holds now: a request of amount 100 with a thousand notes and a
// request of amount 999 with none are different (sameRequest false), as
// are the same two in the other order.
func TestFingerprintLargeRequestIsComparedWithASmallOne(t *testing.T) {
	t.Parallel()
	msg := &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}}
	for i := int32(2); i <= 1200; i++ {
		msg.Field = append(msg.Field, field("note"+strings.Repeat("x", int(i)%7)+string(rune('a'+i%26))+itoa(i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
	}
	md := fpSchema(t, "wide", "proto3", msg)
	req := func(amount uint64, notes int) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), amount)
		for i := 2; i < 2+notes; i++ {
			b = protowire.AppendString(protowire.AppendTag(b, protowire.Number(i), protowire.BytesType), "n")
		}
		return b
	}
	big, small := fpOf(t, md, req(100, 1000)), fpOf(t, md, req(999, 0))
	require.LessOrEqual(t, len(big), maxFieldsLen+64, "sanity: the large one fell back to one leaf")
	require.False(t, sameRequest(big, fpOf(t, md, req(999, 1000))), "sanity: two large ones are compared")
	require.False(t, sameRequest(big, small), "amount 100 with notes against amount 999 without: a different request")
	require.False(t, sameRequest(small, big))
}

func itoa(i int32) string {
	return strings.TrimLeft(string([]byte{byte('0' + i/1000%10), byte('0' + i/100%10), byte('0' + i/10%10), byte('0' + i%10)}), "0")
}

// The defect: "a singular scalar equal to its zero value counts as absent"
// is wrong for a proto2 (or editions) field with a declared default: an
// unset field reads as its default, so unset and an explicit 0 / false
// are different requests to the handler, yet both fingerprint as absent.
//
// What holds now: with `optional bool capture = 2 [default = true]`,
// a request leaving capture unset (capture the payment) and one sending
// capture = false (authorise only) are different requests; likewise
// `optional int64 quantity = 3 [default = 1]` unset against quantity = 0.
func TestFingerprintProto2DefaultUnsetVsExplicitZero(t *testing.T) {
	t.Parallel()
	capture := field("capture", 2, descriptorpb.FieldDescriptorProto_TYPE_BOOL, optional)
	capture.DefaultValue = proto.String("true")
	qty := field("quantity", 3, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)
	qty.DefaultValue = proto.String("1")
	md := fpSchema(t, "defaults", "proto2", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional), capture, qty}})
	amount := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
	unset := fpOf(t, md, amount)
	m := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(amount, m))
	require.True(t, m.Get(md.Fields().ByName("capture")).Bool(), "sanity: unset reads as the default, true")

	explicitFalse := protowire.AppendVarint(protowire.AppendTag(slicesClone(amount), 2, protowire.VarintType), 0)
	require.False(t, sameRequest(unset, fpOf(t, md, explicitFalse)), "capture unset (true) against capture=false: a different request")
	explicitZero := protowire.AppendVarint(protowire.AppendTag(slicesClone(amount), 3, protowire.VarintType), 0)
	require.False(t, sameRequest(unset, fpOf(t, md, explicitZero)), "quantity unset (1) against quantity=0: a different request")
}

// The defect, the mirror of the one above: a client rebuilt to set a
// proto2 field explicitly to its declared default (the value it had
// anyway) sends the same logical request, yet it is KEY_REUSED, whose
// message tells the client to use a new key.
//
// What holds now: unset and explicitly set to the default are the same
// request (the rule the package applies to zero values).
func TestFingerprintProto2ExplicitDefaultIsTheSameRequest(t *testing.T) {
	t.Parallel()
	qty := field("quantity", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)
	qty.DefaultValue = proto.String("1")
	md := fpSchema(t, "defaults2", "proto2", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional), qty}})
	amount := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
	explicit := protowire.AppendVarint(protowire.AppendTag(slicesClone(amount), 2, protowire.VarintType), 1)
	require.True(t, sameRequest(fpOf(t, md, amount), fpOf(t, md, explicit)), "quantity unset (reads 1) against quantity=1 sent: the same request")
}

// The defect across a deploy: the schema digest of a map claims "field
// names do not count", but a map's entry message is named after its field
// (tags -> TagsEntry), and the digest hashes message names. Renaming a
// map field (wire-compatible, a common clean-up) makes the map not
// comparable between the releases, so a request with another map replays
// the old response.
//
// What holds now: with `map<string,int64> lines = 2` renamed to
// `map<string,int64> items = 2`, {a: 1} on v1 and {a: 999} on v2 are
// different requests.
func TestFingerprintRenamedMapFieldIsStillCompared(t *testing.T) {
	t.Parallel()
	schema := func(file, name string) protoreflect.MessageDescriptor {
		entry := strings.ToUpper(name[:1]) + name[1:] + "Entry"
		return fpSchema(t, file, "proto3", &descriptorpb.DescriptorProto{
			Field: []*descriptorpb.FieldDescriptorProto{
				field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				fpMsgField(name, 2, ".adv."+file+".M."+entry, repeated),
			},
			NestedType: []*descriptorpb.DescriptorProto{{
				Name: proto.String(entry), Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
				Field: []*descriptorpb.FieldDescriptorProto{
					field("key", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional),
					field("value", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				},
			}},
		})
	}
	// Same package name for both releases: only the field's name differs.
	v1, v2 := schema("ren", "lines"), schemaRenamed(t)
	req := func(v uint64) []byte {
		e := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "a")
		e = protowire.AppendVarint(protowire.AppendTag(e, 2, protowire.VarintType), v)
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
		return protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), e)
	}
	require.False(t, sameRequest(fpOf(t, v1, req(1)), fpOf(t, v1, req(999))), "sanity: one release compares the map")
	require.True(t, sameRequest(fpOf(t, v1, req(1)), fpOf(t, v2, req(1))), "sanity: the genuine retry replays")
	require.False(t, sameRequest(fpOf(t, v1, req(1)), fpOf(t, v2, req(999))), "another map value across the rename: a different request")
}

// schemaRenamed is release 2 of TestFingerprintRenamedMapFieldIsStillCompared's
// schema: the same package and message, the map field renamed.
func schemaRenamed(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/ren2.proto"), Package: proto.String("adv.ren"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("M"),
			Field: []*descriptorpb.FieldDescriptorProto{
				field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				fpMsgField("items", 2, ".adv.ren.M.ItemsEntry", repeated),
			},
			NestedType: []*descriptorpb.DescriptorProto{{
				Name: proto.String("ItemsEntry"), Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
				Field: []*descriptorpb.FieldDescriptorProto{
					field("key", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional),
					field("value", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				},
			}},
		}},
	}, nil)
	require.NoError(t, err)
	return fd.Messages().ByName("M")
}

// The defect (cost): the node of a request is built whole before its size is
// checked against maxFieldsLen, and every present message writes an entry
// for every field its schema declares. A small request of many empty
// singular sub-messages of a wide, recursive type therefore makes a
// fingerprint buffer hundreds of times its own size (a 4 MiB request,
// gRPC's default limit, allocates gigabytes) on every keyed call, before
// the handler runs.
//
// What holds now: the work and memory of a fingerprint are bounded by
// a small multiple of the request's size (here: under 2 MiB for a request
// of about 7 KiB; one level more, 109 KiB, allocates 300 MiB and takes
// seconds), e.g. by stopping the node walk once it outgrows maxFieldsLen.
func TestFingerprintCostIsBoundedByTheRequestSize(t *testing.T) { // not parallel: it reads the process's allocation count
	msg := &descriptorpb.DescriptorProto{}
	for i := int32(1); i <= 15; i++ {
		msg.Field = append(msg.Field, fpMsgField("c"+itoa(i), i, ".adv.wide2.M", optional))
	}
	for i := int32(16); i <= 300; i++ {
		msg.Field = append(msg.Field, field("s"+itoa(i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
	}
	md := fpSchema(t, "wide2", "proto3", msg)
	// A tree: every node has 15 children, three levels below the root:
	// 1+15+225+3375 messages, each writing 300 entries.
	var tree func(depth int) []byte
	tree = func(depth int) []byte {
		var b []byte
		if depth == 0 {
			return b
		}
		for i := 1; i <= 15; i++ {
			b = protowire.AppendBytes(protowire.AppendTag(b, protowire.Number(i), protowire.BytesType), tree(depth-1))
		}
		return b
	}
	wire := tree(3)
	m := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(wire, m))
	_ = mustFP(t, m) // warm the plan caches
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fp := mustFP(t, m)
	runtime.ReadMemStats(&after)
	allocated := after.TotalAlloc - before.TotalAlloc
	t.Logf("request %d bytes, fingerprint %d bytes, allocated %d bytes", len(wire), len(fp), allocated)
	require.Less(t, allocated, uint64(2<<20), "a %d-byte request must not cost %d bytes to fingerprint", len(wire), allocated)
}

// The defect (crash): a run-time schema (a proxy, a reflection-driven server)
// may carry its own message named google.protobuf.Any; planOf treats any
// message of that name with fields 1 and 2 as an Any and anyParts calls
// Bytes() on field 2 whatever its kind, which panics and takes the server
// down (grpc-go does not recover handler panics).
//
// What holds now: Fingerprint never panics; a message that is not
// really an Any (field 2 not bytes) is fingerprinted as an ordinary one.
func TestFingerprintLookalikeAnyDoesNotPanic(t *testing.T) {
	t.Parallel()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/fakeany.proto"), Package: proto.String("google.protobuf"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("Any"), Field: []*descriptorpb.FieldDescriptorProto{
			field("type_url", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional),
			field("value", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		}}},
	}, nil)
	require.NoError(t, err)
	m := dynamicpb.NewMessage(fd.Messages().Get(0))
	m.Set(fd.Messages().Get(0).Fields().ByNumber(2), protoreflect.ValueOfInt64(5))
	require.NotPanics(t, func() { _, _ = Fingerprint("/fp.Svc/Call", m) })
}

// The defect, minor: an Any of a linked type whose bytes do not decode
// (here a StringValue holding invalid UTF-8) is fingerprinted with its
// field 2 as bytes, and a decodable one with field 2 as a message; the
// tags differ, sameNode skips field 2, and only the type names are
// compared. A handler that forwards the Any unopened (a gateway) thus
// gets a different payload answered with the old response.
//
// What holds now: Any{StringValue "charge"} and Any{StringValue, bytes
// that do not decode} are different requests.
func TestFingerprintLinkedAnyWithUndecodableBytesIsCompared(t *testing.T) {
	t.Parallel()
	good, err := proto.Marshal(wrapperspb.String("charge"))
	require.NoError(t, err)
	bad := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "\xff")
	url := "type.googleapis.com/google.protobuf.StringValue"
	require.False(t, sameRequest(mustFP(t, &anypb.Any{TypeUrl: url, Value: good}), mustFP(t, &anypb.Any{TypeUrl: url, Value: bad})),
		"another payload of the same Any type: a different request")
}

// The defect across a rebuild: an Any's packed type linked in by a
// rebuild (its generated code now imported) turns field 2 of the Any's
// node from bytes into a message; the tags differ, so the payload is not
// compared at all between the releases, and a changed amount inside the
// Any replays the old response. Both sides could compare it: the bytes
// are there on both.
//
// What holds now: Any{adv.linkin.Charge{amount: 100}} fingerprinted
// before the type is linked in and Any{adv.linkin.Charge{amount: 999}}
// after are different requests.
func TestFingerprintAnyTypeLinkedInByARebuildIsStillCompared(t *testing.T) {
	t.Parallel()
	md := fpSchema(t, "linkin", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}})
	charge := func(n uint64) *anypb.Any {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), n)
		return &anypb.Any{TypeUrl: "type.googleapis.com/adv.linkin.M", Value: b}
	}
	before := mustFP(t, charge(100))
	require.False(t, sameRequest(before, mustFP(t, charge(999))), "sanity: unlinked, the bytes are compared")
	require.NoError(t, protoregistry.GlobalTypes.RegisterMessage(dynamicpb.NewMessageType(md)))
	after := mustFP(t, charge(100))
	require.True(t, sameRequest(before, after), "sanity: the genuine retry replays")
	require.False(t, sameRequest(before, mustFP(t, charge(999))), "another amount in the Any across the rebuild: a different request")
}

// The defect (cost, minor): scalars of a list are appended to the walker's
// buffer without spill(), so a repeated int64 of N elements is copied
// whole into a buffer grown by doubling before it is hashed (a 3 MB list
// allocates about 17 MB per call); strings and bytes are hashed in
// 512-byte chunks.
//
// What holds now: fingerprinting a 600 KB packed list allocates no
// more than the walker's fixed buffers and the fingerprint (under 64 KiB).
func TestFingerprintLongScalarListIsHashedInChunks(t *testing.T) { // not parallel: it reads the process's allocation count
	md := fpSchema(t, "longlist", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("xs", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, repeated)}})
	var p []byte
	for i := range 100000 {
		p = protowire.AppendVarint(p, uint64(1<<40+i))
	}
	m := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), p), m))
	_ = mustFP(t, m)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_ = mustFP(t, m)
	runtime.ReadMemStats(&after)
	require.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(64<<10), "a %d-byte list must be hashed as it is walked", len(p))
}

// The defect, across a client rebuild (and on one server): an Any whose
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
// What holds now: Any{Opts, ""} and Any{Opts, "08 00"} with Opts
// linked in both unpack to Opts{}: the same request (sameRequest true),
// as {notify: false} and {} are at the top level.
func TestFingerprintLinkedAnyEmptyValueAndExplicitDefaultAreOneRequest(t *testing.T) {
	t.Parallel()
	opts := fpSchema(t, "adv2anyopt", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("notify", 1, descriptorpb.FieldDescriptorProto_TYPE_BOOL, optional)}})
	require.NoError(t, protoregistry.GlobalTypes.RegisterMessage(dynamicpb.NewMessageType(opts)))
	md := fpSchema(t, "adv2anyreq", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		field("notify", 2, descriptorpb.FieldDescriptorProto_TYPE_BOOL, optional),
		fpMsgField("opts", 3, ".google.protobuf.Any", optional)}}, "google/protobuf/any.proto")
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

// The defect, one schema, no deploy: a request whose fingerprint is cut
// and another of the same schema that is not are compared only before the
// cut; the fields after it are "not compared" (absentAlike: past the cut),
// and whole is compared only when both are cut. A request holding exactly
// the fields written before the cut (the first K notes) is not cut, and
// replays the cut one ({1100 notes, amount 100}) on one server, though it
// lacks the amount and 1100-K notes. The README says the fields after the
// cut are "compared only with a request of the same schema": this one is
// of the same schema. Since the whole hash depends on the schema digest
// alone, it could be kept in every version 3 fingerprint and compared
// whenever the digests agree, cut or not.
//
// What holds now: on one schema, a cut request and an uncut one that
// differ after the cut are different requests (sameRequest false).
func TestFingerprintCutAgainstUncutOfTheSameSchemaIsAnotherRequest(t *testing.T) {
	t.Parallel()
	msg := &descriptorpb.DescriptorProto{Name: proto.String("M")}
	for i := int32(1); i <= 1200; i++ {
		msg.Field = append(msg.Field, field(fmt.Sprintf("n%d", i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
	}
	msg.Field = append(msg.Field, field("amount", 2000, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional))
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/adv2cut.proto"), Package: proto.String("adv.adv2cut"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	md := fd.Messages().Get(0)
	req := func(notes int, amount uint64) []byte {
		var b []byte
		for i := 1; i <= notes; i++ {
			b = protowire.AppendString(protowire.AppendTag(b, protowire.Number(i), protowire.BytesType), "n")
		}
		return protowire.AppendVarint(protowire.AppendTag(b, 2000, protowire.VarintType), amount)
	}
	big := fpOf(t, md, req(1100, 100))
	doc, ok := readFields(big[fieldsHeadLen:])
	require.True(t, ok)
	require.True(t, doc.root.cut, "sanity: the large request is cut")
	require.False(t, sameRequest(big, fpOf(t, md, req(1100, 999))), "sanity: two cut requests of one schema are compared after the cut")
	k := int(doc.root.entries[len(doc.root.entries)-1].num)
	t.Logf("cut after note %d", k)
	var prefix []byte
	for i := 1; i <= k; i++ {
		prefix = protowire.AppendString(protowire.AppendTag(prefix, protowire.Number(i), protowire.BytesType), "n")
	}
	small := fpOf(t, md, prefix)
	sdoc, ok := readFields(small[fieldsHeadLen:])
	require.True(t, ok)
	require.False(t, sdoc.root.cut, "sanity: the first %d notes alone are not cut", k)
	require.False(t, sameRequest(big, small),
		"one schema: {1100 notes, amount 100} against {%d notes, no amount} is a different request", k)
	require.False(t, sameRequest(small, big))
}

// The defect, one build, minor: a message nested deeper than maxNodeDepth
// is one leaf whose hash leaves extensions out (walker.message), so two
// requests that differ only in an extension set nine levels down replay
// one another on one build. The README says such messages "are compared
// whole".
//
// What holds now: on one build with the extension linked in, {...9
// levels... {surcharge: 500}} and the same without it are different
// requests; the same bytes decoded by a build that does not link the
// extension in (it stays an unknown field) are the same request. A leaf
// now carries a hash of the extensions set below it, compared unless one
// side held one undecoded.
func TestFingerprintDeepLeafComparesExtensions(t *testing.T) {
	t.Parallel()
	ext := field("surcharge", 100, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)
	ext.Extendee, ext.JsonName = proto.String(".adv.adv2deepext.M"), nil
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/adv2deepext.proto"), Package: proto.String("adv.adv2deepext"), Syntax: proto.String("proto2"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("M"),
			Field: []*descriptorpb.FieldDescriptorProto{field("sku", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				fpMsgField("next", 2, ".adv.adv2deepext.M", optional)},
			ExtensionRange: []*descriptorpb.DescriptorProto_ExtensionRange{{Start: proto.Int32(100), End: proto.Int32(200)}}}},
		Extension: []*descriptorpb.FieldDescriptorProto{ext},
	}, nil)
	require.NoError(t, err)
	md, fp := extensionFingerprinter(t, fd)
	var nest func(levels int, surcharge uint64) []byte
	nest = func(levels int, surcharge uint64) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 1)
		if levels == 0 {
			if surcharge > 0 {
				b = protowire.AppendVarint(protowire.AppendTag(b, 100, protowire.VarintType), surcharge)
			}
			return b
		}
		return protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), nest(levels-1, surcharge))
	}
	require.False(t, sameRequest(fp(nest(3, 500)), fp(nest(3, 700))), "sanity: a shallow extension is compared")
	require.False(t, sameRequest(fp(nest(10, 500)), fp(nest(10, 700))),
		"one build: surcharge 500 against 700, ten levels down, is a different request")
	require.False(t, sameRequest(fp(nest(10, 500)), fp(nest(10, 0))),
		"one build: surcharge set ten levels down in one request only")
	require.True(t, sameRequest(fp(nest(10, 500)), fp(nest(10, 500))), "sanity: the same request")
	undecoded := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(nest(10, 500), undecoded))
	require.True(t, sameRequest(fp(nest(10, 500)), mustFP(t, undecoded)),
		"the same bytes on a build that does not link the extension in: the same request")
	require.False(t, sameRequest(fp(nest(10, 500)), fp(nest(9, 500))), "sanity: another depth")
}

// wideFields returns fields 1..n alternating int64 and string, so that no
// two neighbours share a run of the type's row.
func wideFields(n int32) []*descriptorpb.FieldDescriptorProto {
	var fs []*descriptorpb.FieldDescriptorProto
	for i := int32(1); i <= n; i++ {
		typ := descriptorpb.FieldDescriptorProto_TYPE_INT64
		if i%2 == 0 {
			typ = descriptorpb.FieldDescriptorProto_TYPE_STRING
		}
		fs = append(fs, field(fmt.Sprintf("f%d", i), i, typ, optional))
	}
	return fs
}

// The defect, one schema, no deploy: a message type whose row is longer
// than maxRowLen (4 KiB: about 200 fields that do not merge into runs, a
// realistic size for a wide "create" request) is written with row 0,
// "fields unknown". absentAlike then treats every field present on one
// side only as one the other schema does not know, and skips it. So on
// one server, {amount: 100} and {amount: 100, capture_only: 1} -- or
// {amount: 100} and {refund: 100} -- are "the same request" and the
// second replays the first's response.
//
// What holds now: on one schema, a field set on one side only (to a
// value other than its default) makes another request: sameRequest is
// false. (A row too long to keep could be replaced by the schema digest
// and compared as known when the digests agree.)
func TestFingerprintWideTypeComparesAFieldSetOnOneSideOnly(t *testing.T) {
	t.Parallel()
	md := fpSchema(t, "adv2wide", "proto3", &descriptorpb.DescriptorProto{Field: wideFields(220)})
	p := planOf(md)
	require.Equal(t, rowDigest, p.row[0], "sanity: the row, longer than maxRowLen, is written as its digest")

	amount := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
	withCapture := protowire.AppendVarint(protowire.AppendTag(slicesClone(amount), 3, protowire.VarintType), 1)
	refund := protowire.AppendVarint(protowire.AppendTag(nil, 5, protowire.VarintType), 100)

	require.False(t, sameRequest(fpOf(t, md, amount), fpOf(t, md, protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 999))),
		"sanity: a field set on both sides is compared")
	require.False(t, sameRequest(fpOf(t, md, amount), fpOf(t, md, withCapture)),
		"one schema: {amount 100} and {amount 100, f3 1} are different requests")
	require.False(t, sameRequest(fpOf(t, md, amount), fpOf(t, md, refund)),
		"one schema: {f1 100} and {f5 100} are different requests")
	require.False(t, sameRequest(fpOf(t, md, amount), fpOf(t, md, nil)),
		"one schema: {amount 100} and {} are different requests")
	require.True(t, sameRequest(fpOf(t, md, withCapture), fpOf(t, md, withCapture)), "sanity: the genuine retry")

	// A deploy that adds a field: the digests differ, and a field set on
	// one side only is skipped, as for a type whose row is listed.
	v2 := fpSchema(t, "adv2widev2", "proto3", &descriptorpb.DescriptorProto{Field: wideFields(221)})
	require.True(t, sameRequest(fpOf(t, md, amount), fpOf(t, v2, amount)), "across the deploy: the genuine retry")
	require.False(t, sameRequest(fpOf(t, md, amount), fpOf(t, v2, protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 999))),
		"across the deploy: a field both know, another value")
}

// The defect, one schema, at the budget's edge: a type met when the
// fingerprint is within a row's length of maxFieldsLen-fieldsReserve has
// its row left out (walker.row), yet its node and entries are still
// written (room() only checks the entries), and the fingerprint is not
// cut. Two such requests -- the same filler, and a nested message that
// holds {amount: 100} in one and nothing (or {refund: 100}) in the other
// -- then compare nothing in that message: the second replays the first.
//
// What holds now: a message whose row was left out is either compared
// as known when both sides are of one schema, or counts as cut (so that
// the whole-request hash decides); either way the two are different
// requests. The walk is now cut where a row does not fit, so the test
// looks for the filler at which Sub's node is the cut one.
func TestFingerprintRowThatDoesNotFitCutsTheWalk(t *testing.T) {
	t.Parallel()
	sub := &descriptorpb.DescriptorProto{Name: proto.String("Sub"), Field: wideFields(40)}
	msg := &descriptorpb.DescriptorProto{Name: proto.String("M"), NestedType: []*descriptorpb.DescriptorProto{sub}}
	for i := int32(1); i <= 1000; i++ {
		msg.Field = append(msg.Field, field(fmt.Sprintf("n%d", i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
	}
	msg.Field = append(msg.Field, fpMsgField("sub", 2000, ".adv.adv2edge.M.Sub", optional))
	md := fpSchema(t, "adv2edge", "proto3", msg)

	req := func(filler int, subWire []byte) []byte {
		var b []byte
		for i := 1; i <= filler; i++ {
			b = protowire.AppendString(protowire.AppendTag(b, protowire.Number(i), protowire.BytesType), "n")
		}
		return protowire.AppendBytes(protowire.AppendTag(b, 2000, protowire.BytesType), subWire)
	}
	amount := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
	refund := protowire.AppendVarint(protowire.AppendTag(nil, 3, protowire.VarintType), 100)

	// Find a filler for which Sub's row no longer fits: the walk is cut
	// there, before Sub's first field.
	found := -1
	for filler := 1000; filler > 500 && found < 0; filler-- {
		fp := fpOf(t, md, req(filler, amount))
		doc, ok := readFields(fp[fieldsHeadLen:])
		require.True(t, ok)
		last := doc.root.entries[len(doc.root.entries)-1]
		if last.num == 2000 && last.node.row == nil {
			require.True(t, doc.root.cut && last.node.cut, "a row that does not fit cuts the walk")
			found = filler
		}
	}
	require.GreaterOrEqual(t, found, 0, "sanity: a filler leaves no room for Sub's row")
	t.Logf("filler %d fields: Sub's row does not fit, the request cut there", found)

	first := fpOf(t, md, req(found, amount))
	require.False(t, sameRequest(first, fpOf(t, md, req(found, protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 999)))),
		"sanity: a field set on both sides is compared")
	require.False(t, sameRequest(first, fpOf(t, md, req(found, nil))),
		"one schema: sub {amount 100} against sub {} is a different request")
	require.False(t, sameRequest(first, fpOf(t, md, req(found, refund))),
		"one schema: sub {f1 100} against sub {f3 100} is a different request")
}

// The defect, one build: an extension is in no row, so one set in one
// request only is "a field the other schema does not know" and skipped --
// even when both requests were fingerprinted by the same binary with the
// extension linked in. {sku: 1, surcharge: 500} and {sku: 1} then replay one another.
//
// What holds now: on one build, an extension set to a non-default
// value on one side only makes another request (the rows could list the
// extensions linked in for the type, or a digest of them).
func TestFingerprintExtensionSetOnOneSideOnlyOnOneBuildIsAnotherRequest(t *testing.T) {
	t.Parallel()
	gift := field("surcharge", 100, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)
	gift.Extendee, gift.JsonName = proto.String(".adv.adv2ext.M"), nil
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/adv2ext.proto"), Package: proto.String("adv.adv2ext"), Syntax: proto.String("proto2"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("M"),
			Field:          []*descriptorpb.FieldDescriptorProto{field("sku", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)},
			ExtensionRange: []*descriptorpb.DescriptorProto_ExtensionRange{{Start: proto.Int32(100), End: proto.Int32(200)}}}},
		Extension: []*descriptorpb.FieldDescriptorProto{gift},
	}, nil)
	require.NoError(t, err)
	md, fp := extensionFingerprinter(t, fd)
	sku := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 1)
	ext := func(v uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(slicesClone(sku), 100, protowire.VarintType), v)
	}
	require.True(t, sameRequest(fp(sku), fp(ext(0))), "sanity: 0 is the extension's default")
	require.False(t, sameRequest(fp(ext(500)), fp(ext(700))), "sanity: set on both sides, compared")
	require.False(t, sameRequest(fp(sku), fp(ext(500))), "one build: {sku 1} and {sku 1, surcharge 500} are different requests")
	require.False(t, sameRequest(fp(ext(500)), fp(sku)))
	undecoded := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(ext(500), undecoded))
	require.True(t, sameRequest(fp(ext(500)), mustFP(t, undecoded)),
		"the same bytes on a build that does not link the extension in: the same request")
	require.True(t, sameRequest(mustFP(t, undecoded), fp(ext(500))))
}

// extensionFingerprinter returns message M of fd and a function that
// fingerprints M decoded from wire on a build that links fd's first
// extension in.
func extensionFingerprinter(t *testing.T, fd protoreflect.FileDescriptor) (protoreflect.MessageDescriptor, func(wire []byte) []byte) {
	t.Helper()
	types := new(protoregistry.Types)
	require.NoError(t, types.RegisterExtension(dynamicpb.NewExtensionType(fd.Extensions().Get(0))))
	md := fd.Messages().ByName("M")
	return md, func(wire []byte) []byte {
		m := dynamicpb.NewMessage(md)
		require.NoError(t, proto.UnmarshalOptions{Resolver: types}.Unmarshal(wire, m))
		return mustFP(t, m)
	}
}

// The defect, minor: walker.value hashes a map's entries (in a leaf below
// maxNodeDepth, and in the whole-request hash of every cut request) with
// single() but never spill(), so the scalars of a map<int64, int64> are
// all copied into the walker's buffer, grown by doubling, before they are
// hashed: the list case fixed before, for maps. A 4.8 MB
// request of 300k entries allocates about 38 MB per call (this test uses
// 100k); its keys are also sorted twice, once for the node walk though
// only a few hundred entries fit before the cut.
//
// What holds now: hashing a map's entries keeps the buffer within its
// first array plus one entry (cap(buf) of at most 2 * len(small)).
func TestFingerprintMapInALeafIsHashedInChunks(t *testing.T) { // not parallel: it reads the process's allocation count
	entry := &descriptorpb.DescriptorProto{Name: proto.String("QEntry"), Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
		Field: []*descriptorpb.FieldDescriptorProto{field("key", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
			field("value", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}}
	md := fpSchema(t, "adv2costmap", "proto3", &descriptorpb.DescriptorProto{NestedType: []*descriptorpb.DescriptorProto{entry},
		Field: []*descriptorpb.FieldDescriptorProto{fpMsgField("q", 1, ".adv.adv2costmap.M.QEntry", repeated)}})
	var wire []byte
	for i := range 100000 {
		e := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), uint64(1<<40+i))
		e = protowire.AppendVarint(protowire.AppendTag(e, 2, protowire.VarintType), uint64(1<<40+i))
		wire = protowire.AppendBytes(protowire.AppendTag(wire, 1, protowire.BytesType), e)
	}
	m := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(wire, m))
	_ = mustFP(t, m)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fp := mustFP(t, m)
	runtime.ReadMemStats(&after)
	t.Logf("wire %d, fp %d, alloc %d mallocs %d", len(wire), len(fp), after.TotalAlloc-before.TotalAlloc, after.Mallocs-before.Mallocs)
	w := newWalker()
	fd := md.Fields().ByNumber(1)
	w.value(fd, m.Get(fd))
	require.LessOrEqual(t, cap(w.buf), 2*len(w.small), "a map's entries must be hashed as they are walked, not buffered whole")

	// The node walk sorts only the keys that can fit before the cut: the
	// entries written are still the first keys, in order.
	doc, ok := readFields(fp[fieldsHeadLen:])
	require.True(t, ok)
	require.True(t, doc.root.cut)
	items := doc.root.entries[0].items
	require.Greater(t, len(items), 100)
	for i, it := range items {
		kw := newWalker()
		kw.single(fd.MapKey(), protoreflect.ValueOfInt64(1<<40+int64(i)))
		require.Equal(t, kw.sum(nil), it.key, "entry %d: the %dth key", i, i)
	}
}

// panicRefl is a message whose Range panics after yielding its fields
// (those of m), with its message fields wrapped likewise when deep > 0.
type panicRefl struct {
	protoreflect.Message
	deep int
}

func (p panicRefl) Range(f func(protoreflect.FieldDescriptor, protoreflect.Value) bool) {
	p.Message.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() != nil && !fd.IsList() && !fd.IsMap() && p.deep > 0 {
			v = protoreflect.ValueOfMessage(panicRefl{v.Message(), p.deep - 1})
		}
		return f(fd, v)
	})
	if p.deep == 0 {
		panic("mid-walk")
	}
}

type panicReq struct{ m protoreflect.Message }

func (p panicReq) ProtoReflect() protoreflect.Message { return panicRefl{p.m, 2} }

// A panic mid-walk leaves no dirty walker behind, and 16
// goroutines fingerprinting a mix of requests (maps, Anys, large and
// small) through the pool get the same fingerprints as one does.
func TestFingerprintWalkerPoolIsCleanAfterAPanicAndUnderConcurrency(t *testing.T) {
	md := fpSchema(t, "adv2pool", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		fpMsgField("next", 2, ".adv.adv2pool.M", optional),
		field("note", 3, descriptorpb.FieldDescriptorProto_TYPE_STRING, repeated),
	}})
	var nest func(levels int, amount uint64, notes int) []byte
	nest = func(levels int, amount uint64, notes int) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), amount)
		for i := range notes {
			b = protowire.AppendString(protowire.AppendTag(b, 3, protowire.BytesType), string(rune('a'+i%26)))
		}
		if levels > 0 {
			b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), nest(levels-1, amount+1, notes))
		}
		return b
	}
	reqs := [][]byte{nest(3, 100, 1), nest(12, 5, 3), nest(2, 7, 3000), nest(0, 1, 0)}
	want := make([][]byte, len(reqs))
	for i, r := range reqs {
		want[i] = fpOf(t, md, r)
	}
	for range 5 {
		m := dynamicpb.NewMessage(md)
		require.NoError(t, proto.Unmarshal(reqs[0], m))
		require.Panics(t, func() { _, _ = Fingerprint("/fp.Svc/Call", panicReq{m}) })
		for i, r := range reqs {
			require.Equal(t, want[i], fpOf(t, md, r), "after a panic mid-walk")
		}
	}
	var wg sync.WaitGroup
	errs := make(chan string, 16)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := range 20 {
				i := (g + n) % len(reqs)
				m := dynamicpb.NewMessage(md)
				if err := proto.Unmarshal(reqs[i], m); err != nil {
					errs <- err.Error()
					return
				}
				fp, _ := Fingerprint("/fp.Svc/Call", m)
				if !bytes.Equal(fp, want[i]) {
					errs <- "fingerprint differs under concurrency"
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	runtime.GC()
}
