package idempotency

import (
	"runtime"
	"strings"
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

// advSchema builds message "adv.<file>.M" in a file of its own that may
// import the well-known types.
func advSchema(t *testing.T, file, syntax string, msg *descriptorpb.DescriptorProto, deps ...string) protoreflect.MessageDescriptor {
	t.Helper()
	msg.Name = proto.String("M")
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/" + file + ".proto"), Package: proto.String("adv." + file), Syntax: proto.String(syntax),
		Dependency: deps, MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().ByName("M")
}

func advMsgField(name string, num int32, typeName string, label descriptorpb.FieldDescriptorProto_Label) *descriptorpb.FieldDescriptorProto {
	f := field(name, num, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, label)
	f.TypeName = proto.String(typeName)
	return f
}

func advAny(t *testing.T, m proto.Message) []byte {
	t.Helper()
	a, err := anypb.New(m)
	require.NoError(t, err)
	b, err := proto.Marshal(a)
	require.NoError(t, err)
	return b
}

// Defect (b): a list (or map) of messages is one leaf whose schema digest
// is salted with what its *values* hold (walker.dyn: one entry per Any
// and per extension present). Two different lists of Anys on one server,
// one schema, no deploy, then have different digests, sameEntry calls them
// "not comparable", and the second request replays the first's response.
//
// Correct behaviour: on one schema, [Any(100)] and [Any(100), Any(100)]
// (one charge line against two), or [Any(StringValue)] against
// [Any(Int64Value)], are different requests: sameRequest is false, so the
// key is KEY_REUSED.
func TestAdvFPListOfAnysOfAnotherLengthIsAnotherRequest(t *testing.T) {
	t.Parallel()
	md := advSchema(t, "anylist", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		advMsgField("lines", 2, ".google.protobuf.Any", repeated),
	}}, "google/protobuf/any.proto")
	req := func(lines ...proto.Message) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
		for _, l := range lines {
			b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), advAny(t, l))
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

// Defect (b), same family: a list of proto2 messages with an extension
// range; an extension present in one request's element and not in the
// other's salts the leaf digest, so the lists are never compared.
//
// Correct behaviour: [{sku: 1, gift: true}] and [{sku: 2}] on one build
// (the extension linked in) are different requests.
func TestAdvFPListWithExtensionInOneRequestOnlyIsCompared(t *testing.T) {
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
			advMsgField("items", 1, ".adv.extlist.Item", repeated)}}, item},
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

// Defect (b): a request whose per-field fingerprint outgrows maxFieldsLen
// becomes one leaf under field number 0. Another request of the same
// method that stays small has no field number in common with it, so
// sameNode finds nothing to compare and calls them the same request.
//
// Correct behaviour: a request of amount 100 with a thousand notes and a
// request of amount 999 with none are different (sameRequest false), as
// are the same two in the other order.
func TestAdvFPLargeRequestIsComparedWithASmallOne(t *testing.T) {
	t.Parallel()
	msg := &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}}
	for i := int32(2); i <= 1200; i++ {
		msg.Field = append(msg.Field, field("note"+strings.Repeat("x", int(i)%7)+string(rune('a'+i%26))+itoa(i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
	}
	md := advSchema(t, "wide", "proto3", msg)
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

// Defect (b): "a singular scalar equal to its zero value counts as absent"
// is wrong for a proto2 (or editions) field with a declared default: an
// unset field reads as its default, so unset and an explicit 0 / false
// are different requests to the handler, yet both fingerprint as absent.
//
// Correct behaviour: with `optional bool capture = 2 [default = true]`,
// a request leaving capture unset (capture the payment) and one sending
// capture = false (authorise only) are different requests; likewise
// `optional int64 quantity = 3 [default = 1]` unset against quantity = 0.
func TestAdvFPProto2DefaultUnsetVsExplicitZero(t *testing.T) {
	t.Parallel()
	capture := field("capture", 2, descriptorpb.FieldDescriptorProto_TYPE_BOOL, optional)
	capture.DefaultValue = proto.String("true")
	qty := field("quantity", 3, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)
	qty.DefaultValue = proto.String("1")
	md := advSchema(t, "defaults", "proto2", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
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

// Defect (a), the mirror of the one above: a client rebuilt to set a
// proto2 field explicitly to its declared default (the value it had
// anyway) sends the same logical request, yet it is KEY_REUSED, whose
// message tells the client to use a new key.
//
// Correct behaviour: unset and explicitly set to the default are the same
// request (the rule the package applies to zero values).
func TestAdvFPProto2ExplicitDefaultIsTheSameRequest(t *testing.T) {
	t.Parallel()
	qty := field("quantity", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)
	qty.DefaultValue = proto.String("1")
	md := advSchema(t, "defaults2", "proto2", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional), qty}})
	amount := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 100)
	explicit := protowire.AppendVarint(protowire.AppendTag(slicesClone(amount), 2, protowire.VarintType), 1)
	require.True(t, sameRequest(fpOf(t, md, amount), fpOf(t, md, explicit)), "quantity unset (reads 1) against quantity=1 sent: the same request")
}

// Defect (b) across a deploy: the schema digest of a map claims "field
// names do not count", but a map's entry message is named after its field
// (tags -> TagsEntry), and the digest hashes message names. Renaming a
// map field (wire-compatible, a common clean-up) makes the map not
// comparable between the releases, so a request with another map replays
// the old response.
//
// Correct behaviour: with `map<string,int64> lines = 2` renamed to
// `map<string,int64> items = 2`, {a: 1} on v1 and {a: 999} on v2 are
// different requests.
func TestAdvFPRenamedMapFieldIsStillCompared(t *testing.T) {
	t.Parallel()
	schema := func(file, name string) protoreflect.MessageDescriptor {
		entry := strings.ToUpper(name[:1]) + name[1:] + "Entry"
		return advSchema(t, file, "proto3", &descriptorpb.DescriptorProto{
			Field: []*descriptorpb.FieldDescriptorProto{
				field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				advMsgField(name, 2, ".adv."+file+".M."+entry, repeated),
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

// schemaRenamed is release 2 of TestAdvFPRenamedMapFieldIsStillCompared's
// schema: the same package and message, the map field renamed.
func schemaRenamed(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/ren2.proto"), Package: proto.String("adv.ren"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("M"),
			Field: []*descriptorpb.FieldDescriptorProto{
				field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				advMsgField("items", 2, ".adv.ren.M.ItemsEntry", repeated),
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

// Defect (cost): the node of a request is built whole before its size is
// checked against maxFieldsLen, and every present message writes an entry
// for every field its schema declares. A small request of many empty
// singular sub-messages of a wide, recursive type therefore makes a
// fingerprint buffer hundreds of times its own size (a 4 MiB request,
// gRPC's default limit, allocates gigabytes) on every keyed call, before
// the handler runs.
//
// Correct behaviour: the work and memory of a fingerprint are bounded by
// a small multiple of the request's size (here: under 2 MiB for a request
// of about 7 KiB; one level more, 109 KiB, allocates 300 MiB and takes
// seconds), e.g. by stopping the node walk once it outgrows maxFieldsLen.
func TestAdvFPCostIsBoundedByTheRequestSize(t *testing.T) { // not parallel: it reads the process's allocation count
	msg := &descriptorpb.DescriptorProto{}
	for i := int32(1); i <= 15; i++ {
		msg.Field = append(msg.Field, advMsgField("c"+itoa(i), i, ".adv.wide2.M", optional))
	}
	for i := int32(16); i <= 300; i++ {
		msg.Field = append(msg.Field, field("s"+itoa(i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
	}
	md := advSchema(t, "wide2", "proto3", msg)
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

// Defect (crash): a run-time schema (a proxy, a reflection-driven server)
// may carry its own message named google.protobuf.Any; planOf treats any
// message of that name with fields 1 and 2 as an Any and anyParts calls
// Bytes() on field 2 whatever its kind, which panics and takes the server
// down (grpc-go does not recover handler panics).
//
// Correct behaviour: Fingerprint never panics; a message that is not
// really an Any (field 2 not bytes) is fingerprinted as an ordinary one.
func TestAdvFPLookalikeAnyDoesNotPanic(t *testing.T) {
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

// Defect (b), minor: an Any of a linked type whose bytes do not decode
// (here a StringValue holding invalid UTF-8) is fingerprinted with its
// field 2 as bytes, and a decodable one with field 2 as a message; the
// tags differ, sameNode skips field 2, and only the type names are
// compared. A handler that forwards the Any unopened (a gateway) thus
// gets a different payload answered with the old response.
//
// Correct behaviour: Any{StringValue "charge"} and Any{StringValue, bytes
// that do not decode} are different requests.
func TestAdvFPLinkedAnyWithUndecodableBytesIsCompared(t *testing.T) {
	t.Parallel()
	good, err := proto.Marshal(wrapperspb.String("charge"))
	require.NoError(t, err)
	bad := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "\xff")
	url := "type.googleapis.com/google.protobuf.StringValue"
	require.False(t, sameRequest(mustFP(t, &anypb.Any{TypeUrl: url, Value: good}), mustFP(t, &anypb.Any{TypeUrl: url, Value: bad})),
		"another payload of the same Any type: a different request")
}

// Defect (b) across a rebuild: an Any's packed type linked in by a
// rebuild (its generated code now imported) turns field 2 of the Any's
// node from bytes into a message; the tags differ, so the payload is not
// compared at all between the releases, and a changed amount inside the
// Any replays the old response. Both sides could compare it: the bytes
// are there on both.
//
// Correct behaviour: Any{adv.linkin.Charge{amount: 100}} fingerprinted
// before the type is linked in and Any{adv.linkin.Charge{amount: 999}}
// after are different requests.
func TestAdvFPAnyTypeLinkedInByARebuildIsStillCompared(t *testing.T) {
	t.Parallel()
	md := advSchema(t, "linkin", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
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

// Defect (cost, minor): scalars of a list are appended to the walker's
// buffer without spill(), so a repeated int64 of N elements is copied
// whole into a buffer grown by doubling before it is hashed (a 3 MB list
// allocates about 17 MB per call); strings and bytes are hashed in
// 512-byte chunks.
//
// Correct behaviour: fingerprinting a 600 KB packed list allocates no
// more than the walker's fixed buffers and the fingerprint (under 64 KiB).
func TestAdvFPLongScalarListIsHashedInChunks(t *testing.T) { // not parallel: it reads the process's allocation count
	md := advSchema(t, "longlist", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
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
