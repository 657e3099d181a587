package idempotency

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// Defect (b), one schema, no deploy: a request whose fingerprint is cut
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
// Correct behaviour: on one schema, a cut request and an uncut one that
// differ after the cut are different requests (sameRequest false).
func TestAdv2FPCutAgainstUncutOfTheSameSchemaIsAnotherRequest(t *testing.T) {
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

// Defect (b), one build, minor: a message nested deeper than maxNodeDepth
// is one leaf whose hash leaves extensions out (walker.message), so two
// requests that differ only in an extension set nine levels down replay
// one another on one build. The README says such messages "are compared
// whole".
//
// Correct behaviour: on one build with the extension linked in, {...9
// levels... {surcharge: 500}} and the same without it are different
// requests; the same bytes decoded by a build that does not link the
// extension in (it stays an unknown field) are the same request. A leaf
// now carries a hash of the extensions set below it, compared unless one
// side held one undecoded.
func TestAdv2FPDeepLeafComparesExtensions(t *testing.T) {
	t.Parallel()
	ext := field("surcharge", 100, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)
	ext.Extendee, ext.JsonName = proto.String(".adv.adv2deepext.M"), nil
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("adv/adv2deepext.proto"), Package: proto.String("adv.adv2deepext"), Syntax: proto.String("proto2"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("M"),
			Field: []*descriptorpb.FieldDescriptorProto{field("sku", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
				advMsgField("next", 2, ".adv.adv2deepext.M", optional)},
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
