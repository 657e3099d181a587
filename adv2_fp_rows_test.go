package idempotency

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
	"google.golang.org/protobuf/types/dynamicpb"
)

// adv2Wide returns fields 1..n alternating int64 and string, so that no
// two neighbours share a run of the type's row.
func adv2Wide(n int32) []*descriptorpb.FieldDescriptorProto {
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

// Defect (b), one schema, no deploy: a message type whose row is longer
// than maxRowLen (4 KiB: about 200 fields that do not merge into runs, a
// realistic size for a wide "create" request) is written with row 0,
// "fields unknown". absentAlike then treats every field present on one
// side only as one the other schema does not know, and skips it. So on
// one server, {amount: 100} and {amount: 100, capture_only: 1} -- or
// {amount: 100} and {refund: 100} -- are "the same request" and the
// second replays the first's response.
//
// Correct behaviour: on one schema, a field set on one side only (to a
// value other than its default) makes another request: sameRequest is
// false. (A row too long to keep could be replaced by the schema digest
// and compared as known when the digests agree.)
func TestAdv2FPWideTypeComparesAFieldSetOnOneSideOnly(t *testing.T) {
	t.Parallel()
	md := advSchema(t, "adv2wide", "proto3", &descriptorpb.DescriptorProto{Field: adv2Wide(220)})
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
	v2 := advSchema(t, "adv2widev2", "proto3", &descriptorpb.DescriptorProto{Field: adv2Wide(221)})
	require.True(t, sameRequest(fpOf(t, md, amount), fpOf(t, v2, amount)), "across the deploy: the genuine retry")
	require.False(t, sameRequest(fpOf(t, md, amount), fpOf(t, v2, protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 999))),
		"across the deploy: a field both know, another value")
}

// Defect (b), one schema, at the budget's edge: a type met when the
// fingerprint is within a row's length of maxFieldsLen-fieldsReserve has
// its row left out (walker.row), yet its node and entries are still
// written (room() only checks the entries), and the fingerprint is not
// cut. Two such requests -- the same filler, and a nested message that
// holds {amount: 100} in one and nothing (or {refund: 100}) in the other
// -- then compare nothing in that message: the second replays the first.
//
// Correct behaviour: a message whose row was left out is either compared
// as known when both sides are of one schema, or counts as cut (so that
// the whole-request hash decides); either way the two are different
// requests. The walk is now cut where a row does not fit, so the test
// looks for the filler at which Sub's node is the cut one.
func TestAdv2FPRowThatDoesNotFitCutsTheWalk(t *testing.T) {
	t.Parallel()
	sub := &descriptorpb.DescriptorProto{Name: proto.String("Sub"), Field: adv2Wide(40)}
	msg := &descriptorpb.DescriptorProto{Name: proto.String("M"), NestedType: []*descriptorpb.DescriptorProto{sub}}
	for i := int32(1); i <= 1000; i++ {
		msg.Field = append(msg.Field, field(fmt.Sprintf("n%d", i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, optional))
	}
	msg.Field = append(msg.Field, advMsgField("sub", 2000, ".adv.adv2edge.M.Sub", optional))
	md := advSchema(t, "adv2edge", "proto3", msg)

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

// Defect (b), one build: an extension is in no row, so one set in one
// request only is "a field the other schema does not know" and skipped --
// even when both requests were fingerprinted by the same binary with the
// extension linked in. {sku: 1, surcharge: 500} and {sku: 1} then replay one another.
//
// Correct behaviour: on one build, an extension set to a non-default
// value on one side only makes another request (the rows could list the
// extensions linked in for the type, or a digest of them).
func TestAdv2FPExtensionSetOnOneSideOnlyOnOneBuildIsAnotherRequest(t *testing.T) {
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
